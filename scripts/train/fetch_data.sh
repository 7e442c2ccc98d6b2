#!/usr/bin/env bash
# Fetches the raw training text from Debian packages (the only registries this project reaches) into
# scripts/train/raw/ (git-ignored: ~8 MB, not committed; prepare.py turns it into the
# compressed, cleaned split that IS committed under scripts/train/data/).
#
#   * bible-kjv + bible-kjv-text: the King James Version (1611, public domain), dumped verse by verse with `bible`.
#   * r-cran-janeaustenr: Jane Austen's six complete novels (public domain texts; the R package is MIT),
#     dumped one text line per line with Rscript.
#
# Needs root (apt-get install). Run from the repo root:  bash scripts/train/fetch_data.sh
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
RAW="${RAW:-$HERE/raw}"
mkdir -p "$RAW"

if ! command -v bible >/dev/null || ! command -v Rscript >/dev/null || ! Rscript -e 'library(janeaustenr)' >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bible-kjv bible-kjv-text r-cran-janeaustenr
fi

# -f turns pretty-printing off: one verse per line, "Ge1:1 In the beginning ...".
bible -f "Gen1:1-Rev22:21" > "$RAW/kjv.txt" </dev/null
test "$(wc -l < "$RAW/kjv.txt")" -ge 31000

Rscript -e '
out <- commandArgs(trailingOnly = TRUE)[1]
for (n in c("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")) {
  e <- new.env()
  data(list = n, package = "janeaustenr", envir = e)
  writeLines(e[[n]], file.path(out, paste0("austen_", n, ".txt")), useBytes = TRUE)
}' "$RAW"

# Licence / provenance records shipped by the packages.
cp /usr/share/doc/bible-kjv-text/copyright "$RAW/COPYRIGHT.bible-kjv-text"
cp /usr/share/doc/r-cran-janeaustenr/copyright "$RAW/COPYRIGHT.r-cran-janeaustenr"
dpkg-query -W bible-kjv bible-kjv-text r-cran-janeaustenr > "$RAW/PACKAGES.txt"
wc -c "$RAW"/*.txt
