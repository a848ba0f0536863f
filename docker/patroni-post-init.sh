#!/bin/bash
# Patroni's bootstrap.post_init in the pg_ccm-patroni image: runs once, on the member that
# bootstraps the cluster, with the new primary's connection URL as its argument. Creates pg_ccm
# (it must be preloaded: shared_preload_libraries = pg_ccm) and pg_buffercache in the postgres
# database, and the agent's login role ccm (no superuser: member of ccm_agent, which CREATE
# EXTENSION pg_ccm creates, and pg_monitor). The catalog entries replicate to every replica.
set -euo pipefail
psql -X -v ON_ERROR_STOP=1 -q "$1" <<'SQL'
CREATE EXTENSION pg_ccm;
CREATE EXTENSION pg_buffercache;
CREATE ROLE ccm LOGIN IN ROLE ccm_agent, pg_monitor;
SQL
