# aiayn: `make demo` serves the translation demo on the bundled model; `make test` runs the tests.
# Both create .venv if absent and install the project with the extras these machines need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that lies on this machine's disk; real users install their own torch.
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= cpu,train,export,demo,dev
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: demo test venv lint browser clean help

help:
	@echo "make demo   set up and serve the translation demo on the bundled model"
	@echo "make test   set up and run the test suite (CPU)"
	@echo "make lint   ruff"

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)" -e ".[$(EXTRAS)]"
	@rm -f $(VENV)/.installed-*
	@touch $@

venv: $(STAMP)

# Debian's Chromium and ChromeDriver for the browser test (no browser downloads by test tools).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
			 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) \
			|| echo "note: could not install chromium; the browser test will skip"; \
		else echo "note: chromium/chromedriver absent; the browser test will skip"; fi; \
	fi

demo: $(STAMP)
	$(VENV)/bin/aiayn demo $(DEMO_ARGS)

test: $(STAMP) browser
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
