#!/usr/bin/env bash
# Builds and installs the extension into the system PostgreSQL 15 and builds ccm-agent
# (target/release/ccm-agent). Used by the tests and the demo.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
(cd extension && cargo pgrx install --release --pg-config "$PG_CONFIG" >/dev/null)
cargo build --locked --release -p ccm-agent
