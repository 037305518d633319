# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TESSERA := $(VENV)/bin/tessera
# torch first and pinned: here it is a local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
TORCH  := torch==2.13.0
MODEL  := smollm2-135m
# Two workers, a test file each at a time (module fixtures start one swarm per file).
# Every peer process runs torch on one thread, so two files share the 2 cores fairly.
# Short tracebacks: CI keeps only the tail of the log, and every failure should fit in it.
PYTEST_ARGS ?= -n 2 --dist loadfile --tb=short

.PHONY: install model demo test docs screenshots bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

model: install
	$(TESSERA) model fetch $(MODEL)

demo: model
	$(TESSERA) demo

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

# The manual (docs/pages/, configured by docs/mkdocs.yml) as a static site in site/: open site/index.html.
docs: install
	$(VENV)/bin/mkdocs build --strict --config-file docs/mkdocs.yml

# The manual's screenshots (docs/pages/images/), taken by the tests that drive the web view in chromium
# and the TUI in Textual's pilot: what the docs show is what the tests saw.
screenshots: model
	TESSERA_SCREENSHOTS=docs/pages/images $(PY) -m pytest -p no:randomly -n 0 -q tests/web/test_web_browser.py \
		tests/tui/test_tui.py::test_main_screen_shows_span_coverage_and_live_counters

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .hypothesis
