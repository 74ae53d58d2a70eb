# Two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
STAMP := $(VENV)/.installed
# pip on these machines warns about missing local index folders; hide that noise only.
QUIET := grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: install demo lint test test-unit test-compose bench clean

$(STAMP): pyproject.toml $(wildcard requirements/*.lock) scripts/install.sh
	./scripts/install.sh $(VENV) 2>&1 | { $(QUIET); }
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tandem demo

# ruff's lint and format checks first: seconds, and a failure there names the line. mypy last:
# about a minute from a cold cache ([tool.mypy] in pyproject.toml says what it checks).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python scripts/config_reference.py --check
	$(VENV)/bin/python scripts/code_map.py --check
	$(VENV)/bin/python scripts/sync_k8s_files.py --check
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/python -m pytest tests --durations=25

test-unit: $(STAMP)
	$(VENV)/bin/python -m pytest tests/unit

# docker compose up on this machine's Docker engine, faults and restarts included
# (scripts/test_compose.sh: images from a registry, or built offline from Debian's packages).
test-compose: $(STAMP)
	VENV=$(VENV) scripts/test_compose.sh

bench: $(STAMP)
	$(VENV)/bin/python -m bench all

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
