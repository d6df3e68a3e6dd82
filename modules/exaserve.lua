-- Lmod modulefile for exaserve-hpc.            module use <this dir>; module load exaserve
--
-- Activates the install next to this directory (../.venv, or $EXASERVE_PREFIX when the
-- centre installed elsewhere), sets EXASERVE_SITE, and loads the prerequisite modules
-- the site names. Both come from exaserve.conf beside this file, written at install
-- time from the site config (cluster.modules), one "key=value" a line:
--     site=/proj/ai/exaserve/site-configs/exa256-a100.yaml
--     prereq=cuda/12.4
--     prereq=openmpi/4.1
help([[exaserve-hpc: serve LLMs inside a Slurm allocation (exaserve serve | submit | status)]])
whatis("Name: exaserve-hpc")
whatis("Description: LLM serving control plane for Slurm clusters")

local here = myFileName():match("(.*)/[^/]*$")
local root = here:match("(.*)/[^/]*$")
local prefix = os.getenv("EXASERVE_PREFIX") or pathJoin(root, ".venv")
local site = pathJoin(root, "site-configs", "local.yaml")
local prereqs = {}

local conf = io.open(pathJoin(here, "exaserve.conf"), "r")
if conf then
    for line in conf:lines() do
        local key, value = line:match("^%s*([%w_]+)%s*=%s*(.-)%s*$")
        if key == "site" then site = value
        elseif key == "prereq" and value ~= "" then table.insert(prereqs, value) end
    end
    conf:close()
end

for _, name in ipairs(prereqs) do
    depends_on(name)
end

if not isDir(pathJoin(prefix, "bin")) then
    LmodError("exaserve: no install at " .. prefix .. " (expected " .. pathJoin(prefix, "bin", "exaserve") ..
              "); create it with `python3 -m venv .venv && .venv/bin/pip install -e .` or set EXASERVE_PREFIX")
end
prepend_path("PATH", pathJoin(prefix, "bin"))
setenv("VIRTUAL_ENV", prefix)
setenv("EXASERVE_HOME", root)
setenv("EXASERVE_SITE", site)
setenv("EXASERVE_SITE_DIR", pathJoin(root, "site-configs"))
