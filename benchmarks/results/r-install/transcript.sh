#!/bin/bash
# A fresh R session with only the R package installed (temp library), a temp
# virtualenv root, no RETICULATE_PYTHON: install_ampkit(), then the README quick start.
set -u
# Usage: bash benchmarks/results/r-install/transcript.sh [REPO] > transcript.txt
REPO=$(cd "${1:-$(dirname "$0")/../../..}" && pwd)
# The quick start, as r/ampkit/README.md shows it (the ```r block under "## Quick start").
QS=$(mktemp /tmp/quickstart.XXXX.R)
awk '/^## Quick start/{q=1} q && /^```r/{on=1; next} on && /^```/{exit} on' "$REPO/r/ampkit/README.md" > "$QS"
LIB=$(mktemp -d /tmp/ampkit-lib.XXXX); export WORKON_HOME=$(mktemp -d /tmp/ampkit-venvs.XXXX)
unset RETICULATE_PYTHON AMPKIT_REPO R_LIBS_USER
echo "\$ R CMD INSTALL -l $LIB r/ampkit"; R CMD INSTALL --no-multiarch -l $LIB $REPO/r/ampkit 2>&1 | tail -1
cd /tmp
echo "\$ WORKON_HOME=$WORKON_HOME R_LIBS=$LIB Rscript -e 'library(ampkit); ampkit_available(); tryCatch(ampkit_config(), error = function(e) cat(conditionMessage(e), \"\\n\"))'"
R_LIBS=$LIB Rscript -e 'library(ampkit); print(ampkit_available()); tryCatch(ampkit_config(), error = function(e) cat(conditionMessage(e), "\n"))' 2>&1
echo "\$ WORKON_HOME=$WORKON_HOME R_LIBS=$LIB Rscript -e 'ampkit::install_ampkit(\"$REPO\")'"
time R_LIBS=$LIB Rscript -e "ampkit::install_ampkit(\"$REPO\")" 2>&1 | grep -v "^Requirement already\|^  Using cached\|WARNING: Location" | tail -25
echo "\$ WORKON_HOME=$WORKON_HOME R_LIBS=$LIB Rscript quickstart.R   # r/ampkit/README.md, Quick start"
QS=$QS R_LIBS=$LIB Rscript -e 'source(Sys.getenv("QS"), echo = TRUE, max.deparse.length = Inf); print(ampkit_config()[c("python", "torch", "ampkit")])' 2>&1
rm -rf "$LIB" "$WORKON_HOME" "$QS"
