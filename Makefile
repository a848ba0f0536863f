# The two entry points of README.md. Both set up a fresh machine first (scripts/setup.sh).
#
# PG=N (or ARGS='--pg N') picks the PostgreSQL version of the demo and the benchmarks
# (default: the newest installed); PG_VERSIONS="15 18" narrows the test matrix.
# `make check` is the developers' quick loop (not what CI runs): the unit tests and the smoke
# subset of the integration tests on the newest version.
.PHONY: demo test check bench sql

PG ?= $(shell echo '$(ARGS)' | sed -n 's/.*--pg[ =]*\([0-9][0-9]*\).*/\1/p')
PG_FLAG = $(if $(PG),--pg $(PG))

demo:
	./scripts/setup.sh
	./scripts/install.sh $(PG_FLAG)
	python3 demo/failover_demo.py $(PG_FLAG) $(ARGS)

test:
	./scripts/test.sh

check:
	./scripts/test.sh --quick

bench:
	./scripts/setup.sh
	./scripts/install.sh $(PG_FLAG)
	python3 bench/ccm_bench.py $(PG_FLAG) $(ARGS)

sql:
	./scripts/check-sql.sh --write
