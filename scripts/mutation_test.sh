#!/usr/bin/env bash
# Mutation testing of WnW's policy modules with mutmut (configuration: [tool.mutmut] in
# pyproject.toml; scores and surviving mutants: docs/fidelity.md). Extra arguments go to
# `mutmut run` (e.g. mutant names).
#
# mutmut names a mutant after its file path, while the tests import it under its installed
# name (policies/wnw.py is kvsim.policies.wnw), so it runs in a staging copy of the tracked
# files in which policies/ sits at kvsim/policies/; results stay in that copy (.mutation/).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
stage=${MUTATION_DIR:-.mutation}
rm -rf "$stage"
mkdir -p "$stage"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$stage"
mv "$stage/policies" "$stage/kvsim/policies"
cd "$stage"
nice -n 10 "$root/.venv/bin/mutmut" run --max-children 1 "$@"
"$root/.venv/bin/mutmut" results | tail -n 20
