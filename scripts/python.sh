# Sourced by the set-up, test and demo scripts: PY is the interpreter the project lives in.
# Default: the project's virtual environment .venv (created on first use, reused after);
# PYTHON=/path/to/python overrides it (for example a Python you manage yourself).
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
else
    PY=.venv/bin/python
fi
