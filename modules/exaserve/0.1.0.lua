-- exaserve-hpc 0.1.0, Lmod modulefile.          module use <this modules dir>; module load exaserve
--
-- Settings come from ../exaserve.conf (one key=value a line), which `exaserve modules install DIR
-- --site SITE` writes next to the copied modulefiles:
--   prefix=/opt/exaserve/0.1.0        the install (a virtual environment) whose bin/ holds `exaserve`
--   site=/proj/ai/site/exa256.yaml    the default site config (EXASERVE_SITE)
--   site_dir=/opt/.../site-configs    where `--site NAME` looks (EXASERVE_SITE_DIR)
--   prereq=cuda/12.4                  a module the site needs (cluster.modules), one line each
--   url=https://...                   shown by `module whatis`
-- Without that file a source checkout works as it is: ../../.venv and ../../site-configs.
-- $EXASERVE_PREFIX, when set, wins over prefix=.
local version = "0.1.0"
local here = myFileName():match("(.*)/[^/]*$")          -- .../modules/exaserve
local modules = here:match("(.*)/[^/]*$")               -- .../modules
local root = modules:match("(.*)/[^/]*$")               -- the checkout or install root
local conf = {prefix = pathJoin(root, ".venv"), site = pathJoin(root, "site-configs", "local.yaml"),
              site_dir = pathJoin(root, "site-configs"), url = pathJoin(root, "README.md")}
local prereqs = {}

local fh = io.open(pathJoin(modules, "exaserve.conf"), "r")
if fh then
    for line in fh:lines() do
        local key, value = line:match("^%s*([%w_]+)%s*=%s*(.-)%s*$")
        if key == "prereq" then
            if value ~= "" then table.insert(prereqs, value) end
        elseif key then
            conf[key] = value
        end
    end
    fh:close()
end
local prefix = os.getenv("EXASERVE_PREFIX") or conf.prefix

whatis("Name: exaserve-hpc")
whatis("Version: " .. version)
whatis("Category: AI, LLM inference serving")
whatis("URL: " .. conf.url)
whatis("Description: serve large language models inside a Slurm allocation (OpenAI-compatible gateway)")
help([[
exaserve-hpc ]] .. version .. [[: serve large language models inside one Slurm allocation.

  exaserve submit --site SITE [--dry-run]   render the batch script from a site config and submit it
  exaserve status --run-dir JOBDIR          controller, node agents and replicas of a running job
  exaserve config check FILE                validate a site config (every problem, with its YAML path)
  exaserve serve                            the whole system on this machine (CPU, tiny model)

Sets EXASERVE_SITE (the default --site), EXASERVE_SITE_DIR and PATH (the install's bin/).
Install:  ]] .. prefix .. [[

Site:     ]] .. conf.site .. [[

Settings: ]] .. pathJoin(modules, "exaserve.conf") .. [[ (written by `exaserve modules install`)
]])

conflict("exaserve-hpc")  -- an install published under the distribution's name would fight over PATH
for _, name in ipairs(prereqs) do
    depends_on(name)      -- loaded when absent, unloaded with us when we loaded it
    prereq(name)
end

if not isDir(pathJoin(prefix, "bin")) then
    LmodError("exaserve: no install at " .. prefix .. " (expected " .. pathJoin(prefix, "bin", "exaserve") ..
              "); install with `pip install .` into a virtual environment and run `exaserve modules install`, " ..
              "or set EXASERVE_PREFIX")
end
prepend_path("PATH", pathJoin(prefix, "bin"))
setenv("VIRTUAL_ENV", prefix)
setenv("EXASERVE_HOME", root)
setenv("EXASERVE_SITE", conf.site)
setenv("EXASERVE_SITE_DIR", conf.site_dir)
