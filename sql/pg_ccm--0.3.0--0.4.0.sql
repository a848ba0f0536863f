/* pg_ccm 0.3.0 -> 0.4.0: several standbys per scan, and where a node's WAL comes from.

   ccm_hot_blocks_each() scans the primary's buffers once for several standbys (one filter
   and one list each); ccm_wal_source() tells ccm-agent a node's timeline and WAL sender, so
   that it never warms a standby that follows another primary. Both go to ccm_agent, the
   latter also to pg_monitor, as in a new install. Released scripts are never edited. */

\echo Use "ALTER EXTENSION pg_ccm UPDATE TO '0.4.0'" to load this file. \quit

CREATE FUNCTION "ccm_hot_blocks_each"(
	"filters" bytea[],
	"max_blocks" bigint[],
	"usage_threshold" INT DEFAULT NULL
) RETURNS bytea[]
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_hot_blocks_each_wrapper';

CREATE FUNCTION ccm_wal_source(
    OUT in_recovery bool,
    OUT timeline int4,
    OUT sender_host text,
    OUT sender_port int4
) RETURNS record
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- A primary: the timeline it writes. A standby: the timeline its WAL receiver streams
    -- and from where (NULLs while no WAL receiver runs).
    SELECT r, CASE WHEN r THEN w.received_tli
                   ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int4 END,
           w.sender_host, w.sender_port
    FROM (SELECT pg_is_in_recovery()) AS s(r)
    LEFT JOIN pg_stat_wal_receiver AS w ON r AND w.status = 'streaming'
$$;
COMMENT ON FUNCTION ccm_wal_source() IS 'timeline and WAL sender of this node (for ccm-agent)';

REVOKE ALL ON FUNCTION ccm_hot_blocks_each(bytea[], int8[], int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_wal_source() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ccm_hot_blocks_each(bytea[], int8[], int4) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_wal_source() TO pg_monitor, ccm_agent;
