#%Module1.0
## Tcl modulefile for exaserve-hpc (Environment Modules, or Lmod).  module use <dir>; module load exaserve
##
## Same behaviour as exaserve.lua: activates ../.venv (or $EXASERVE_PREFIX), sets EXASERVE_SITE,
## and loads the prerequisite modules listed in exaserve.conf beside this file
## ("site=PATH" and "prereq=NAME" lines, written at install time from the site config).

proc ModulesHelp { } {
    puts stderr "exaserve-hpc: serve LLMs inside a Slurm allocation (exaserve serve | submit | status)"
}
module-whatis "Name: exaserve-hpc"

set here [file dirname [file normalize $ModulesCurrentModulefile]]
set root [file dirname $here]
if {[info exists env(EXASERVE_PREFIX)]} {
    set prefix $env(EXASERVE_PREFIX)
} else {
    set prefix [file join $root .venv]
}
set site [file join $root site-configs local.yaml]
set prereqs {}

set conf [file join $here exaserve.conf]
if {[file readable $conf]} {
    set fh [open $conf r]
    foreach line [split [read $fh] "\n"] {
        if {[regexp {^\s*(\w+)\s*=\s*(.*?)\s*$} $line -> key value]} {
            if {$key eq "site"} { set site $value }
            if {$key eq "prereq" && $value ne ""} { lappend prereqs $value }
        }
    }
    close $fh
}

foreach name $prereqs {
    if {![is-loaded $name]} { module load $name }
}

if {![file isdirectory [file join $prefix bin]]} {
    error "exaserve: no install at $prefix; create it with `python3 -m venv .venv && .venv/bin/pip install -e .` or set EXASERVE_PREFIX"
}
prepend-path PATH [file join $prefix bin]
setenv VIRTUAL_ENV $prefix
setenv EXASERVE_HOME $root
setenv EXASERVE_SITE $site
setenv EXASERVE_SITE_DIR [file join $root site-configs]
