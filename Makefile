# The two entry points of README.md. Both set up a fresh machine first (scripts/setup.sh).
.PHONY: demo test bench sql

demo:
	./scripts/setup.sh
	./scripts/install.sh
	python3 demo/failover_demo.py $(ARGS)

test:
	./scripts/test.sh

bench:
	./scripts/setup.sh
	./scripts/install.sh
	python3 bench/ccm_bench.py $(ARGS)

sql:
	./scripts/check-sql.sh --write
