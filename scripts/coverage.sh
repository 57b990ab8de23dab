#!/usr/bin/env bash
# Branch coverage of src/kvbridge over the whole suite (or the tests given), with the rank
# processes the tests start: `bash scripts/coverage.sh [pytest args]`. Prints the report per
# module and per package; the engine servers (vLLM's and SGLang's venvs) are not measured.
set -eu
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export COVERAGE_RCFILE="$ROOT/pyproject.toml"
rm -f .coverage .coverage.*
python3 -m coverage run -m pytest -q -p no:cacheprovider "$@" || status=$?
python3 -m coverage combine -q
python3 -m coverage report --format=total > /dev/null  # fails early on an empty combine
python3 - <<'PYEOF'
import collections, coverage
cov = coverage.Coverage(config_file="pyproject.toml")
cov.load()
data = cov.get_data()
per = collections.defaultdict(lambda: [0, 0, 0, 0])  # statements, missed, branches, missed
for path in data.measured_files():
    if "/kvbridge/" not in path:
        continue
    rel = path.split("/kvbridge/", 1)[1]
    pkg = rel.split("/")[0] if "/" in rel else "(top level)"
    a = cov._analyze(path)
    n = a.numbers
    for i, v in enumerate((n.n_statements, n.n_missing, n.n_branches, n.n_missing_branches)):
        per[pkg][i] += v
tot = [sum(v[i] for v in per.values()) for i in range(4)]
print(f"{'package':24} {'stmts':>7} {'miss':>6} {'branch':>7} {'bmiss':>6} {'cover':>6}")
for pkg, (s, m, b, mb) in sorted(per.items()) + [("TOTAL", tot)]:
    cover = 100 * (s - m + b - mb) / max(1, s + b)
    print(f"{pkg:24} {s:7} {m:6} {b:7} {mb:6} {cover:5.1f}%")
PYEOF
exit "${status:-0}"
