# The two commands of the README: `make demo` and `make test`. Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install model demo test lint bench browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch pinned: this version's CPU build is what the machines here install without CUDA.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[worker,dev]'
	touch $(STAMP)

install: $(STAMP)

# `make model MODEL=gemma3-270m` fetches another known model (engine/downloads.py).
MODEL ?= smollm2-135m

model: $(STAMP)
	$(BIN)/python -m tokenq.engine.downloads fetch $(MODEL)

demo: model
	$(BIN)/tokenq demo

# tests/test_dashboard.py loads the gateway's page in Debian's headless chromium; installing
# it needs root (CI's case): elsewhere that test says why it skipped.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) || \
	  echo "chromium not installed (apt-get failed): tests/test_dashboard.py's page test will skip"

test: model browser
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: model
	$(BIN)/tokenq bench engine
