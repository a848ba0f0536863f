/* pg_ccm 0.4.0 -> 0.5.0: the change feed.

   ccm_buffer_changes() reports which blocks entered and left a node's set (a primary's hot
   set, a standby's cached blocks) since its caller's last answer, so that ccm-agent's steady
   cycle costs what changed instead of a filter of all of shared_buffers. Its shared memory
   (20 bytes per buffer) is set up at server start: restart each node with the 0.5.0 library
   before running this update. It goes to ccm_agent only, as in a new install. Released
   scripts are never edited. */

\echo Use "ALTER EXTENSION pg_ccm UPDATE TO '0.5.0'" to load this file. \quit

CREATE FUNCTION "ccm_buffer_changes"(
	"subscriber" bigint,
	"after" bigint,
	"usage_threshold" INT DEFAULT NULL,
	"max_buffers" bigint DEFAULT NULL,
	"probe" bytea DEFAULT NULL
) RETURNS TABLE (
	"seq" bigint,
	"reset" bool,
	"reset_reason" TEXT,
	"buffers" bigint,
	"tracked" bigint,
	"sweeps" bigint,
	"visited" bigint,
	"added" bytea,
	"removed" bytea,
	"present" bytea
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_buffer_changes_wrapper';

REVOKE ALL ON FUNCTION ccm_buffer_changes(int8, int8, int4, int8, bytea) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ccm_buffer_changes(int8, int8, int4, int8, bytea) TO ccm_agent;
