#!/usr/bin/env bash
# The whole test suite, as CI runs it: set-up, the PostgreSQL-free unit tests, the SQL
# install-script check, the #[pg_test]s inside a real server, then the integration tests
# on a real primary and streaming standby.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

"$ROOT/scripts/setup.sh"

echo "==> unit tests (codec, agent)"
cargo test --locked -p ccm-codec -p ccm-walcache -p ccm-agent

echo "==> install script matches the code"
"$ROOT/scripts/check-sql.sh"

echo "==> #[pg_test]s (pgrx, PostgreSQL 15)"
PGRX_TEST_DIR=/tmp/pg_ccm-pgrx-test
install -d -o postgres -g postgres "$PGRX_TEST_DIR"
(cd extension && cargo pgrx test pg15 --runas postgres --pgdata "$PGRX_TEST_DIR/data")

echo "==> integration tests (primary + streaming standby)"
"$ROOT/scripts/install.sh" --test-build
python3 -m pytest -p no:cacheprovider -v tests/integration "$@"
