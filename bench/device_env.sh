# Source this on a lent GPU machine, from the repo root, to run specwire without installing it:
# carried wheels go to /tmp/site and the design-card directories are linked into the import root.
# (Mirrors the package-dir mapping of pyproject.toml.)
ln -sfn "$PWD/kernels" specwire/kernels
ln -sfn "$PWD/drafter_service" specwire/drafter
ln -sfn "$PWD/verifier_service" specwire/verifier
wheels=$(ls .devcarry/wheels/*.whl .devcarry/wmin/*.whl 2>/dev/null)  # whichever set was carried
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
