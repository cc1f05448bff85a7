"""Summarise run_bugs.sh logs: for each bug, each configuration's failing checks.
Usage: python tests/foreign/audit_repro/summarize.py OUTDIR"""
import pathlib
import sys

for log in sorted(pathlib.Path(sys.argv[1]).glob("*.log")):
    lines = log.read_text().splitlines()
    head = next((i for i, l in enumerate(lines) if l.startswith("configuration ")), None)
    if head is None:
        print(f"{log.stem}: no table"); continue
    import re
    spans = [m.span() for m in re.finditer(r"-+", lines[head + 1])]
    cols = [lines[head][a:b + 2].strip() for a, b in spans]
    rows = []
    for l in lines[head + 2:]:
        if not l.strip():
            break
        cells = [l[a:b + 2].strip() for a, b in spans]
        fails = [c for c, v in zip(cols[1:], cells[1:]) if v in ("FAIL", "TIMEOUT")]
        rows.append(f"{cells[0]}: {', '.join(fails) or 'passes'}")
    print(f"{log.stem}:\n  " + "\n  ".join(rows))
