#!/usr/bin/env bash
# Mutation testing, with mutmut, of the modules that implement the papers:
#
#   bash scripts/mutation_test.sh [--target NAME] [MUTANT ...]
#
# NAME is a key of [tool.kvsim.mutation] in pyproject.toml (default wnw): the files mutmut
# mutates and the tests it runs; general settings are in [tool.mutmut]. Mutant names, if
# given, go to `mutmut run`. Scores and the surviving mutants: docs/fidelity.md.
#
# mutmut names a mutant after its file path, while the tests import it under its installed
# name (policies/wnw.py is kvsim.policies.wnw), so it runs in a staging copy of the working
# tree (tracked files and new ones git does not ignore) in which policies/ sits at
# kvsim/policies/; results stay in that copy (.mutation/, or MUTATION_DIR=.mutation_NAME to keep
# two targets' results side by side: .gitignore ignores .mutation*/).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
target=wnw
if [ "${1:-}" = "--target" ]; then target=${2:?--target needs a name}; shift 2; fi
stage=${MUTATION_DIR:-.mutation}
rm -rf "$stage"
mkdir -p "$stage"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$stage"
mv "$stage/policies" "$stage/kvsim/policies"
"$root/.venv/bin/python" scripts/mutation_config.py "$target" "$stage/pyproject.toml"
cd "$stage"
nice -n 10 "$root/.venv/bin/mutmut" run --max-children 1 "$@"
"$root/.venv/bin/mutmut" results | tail -n 20
