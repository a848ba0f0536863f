/* pg_ccm 0.1.0 -> 0.2.0: the logical replication WAL cache (Aurora's monitoring functions
   and pg_ccm's status of the cache). Released scripts are never edited. */

\echo Use "ALTER EXTENSION pg_ccm UPDATE TO '0.2.0'" to load this file. \quit

CREATE FUNCTION "aurora_stat_logical_wal_cache"() RETURNS TABLE (
	"name" TEXT,
	"active_pid" INT,
	"cache_hit" bigint,
	"cache_miss" bigint,
	"blks_read" bigint,
	"hit_rate" TEXT,
	"last_reset_timestamp" timestamp with time zone
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'aurora_stat_logical_wal_cache_wrapper';

CREATE FUNCTION "aurora_stat_reset_wal_cache"(
	"slot_name" TEXT
) RETURNS TEXT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'aurora_stat_reset_wal_cache_wrapper';

CREATE FUNCTION "ccm_logical_wal_cache_status"() RETURNS TABLE (
	"mode" TEXT,
	"size_blocks" bigint,
	"worker_pid" INT,
	"oldest_ptr" pg_lsn,
	"newest_ptr" pg_lsn,
	"held_blocks" bigint,
	"locked_blocks" bigint,
	"lock_limit_bytes" bigint
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_logical_wal_cache_status_wrapper';

CREATE FUNCTION "get_oldest_wal_cache_ptr"() RETURNS pg_lsn
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'get_oldest_wal_cache_ptr_wrapper';

REVOKE ALL ON FUNCTION aurora_stat_logical_wal_cache() FROM PUBLIC;
REVOKE ALL ON FUNCTION aurora_stat_reset_wal_cache(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION get_oldest_wal_cache_ptr() FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_logical_wal_cache_status() FROM PUBLIC;

GRANT EXECUTE ON FUNCTION aurora_stat_logical_wal_cache() TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION get_oldest_wal_cache_ptr() TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_logical_wal_cache_status() TO pg_monitor, ccm_agent;
-- Resetting statistics is for superusers, as pg_stat_reset() is.
