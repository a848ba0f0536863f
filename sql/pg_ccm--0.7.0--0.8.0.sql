/* pg_ccm 0.7.0 -> 0.8.0: the active agent's report of the failover candidates, in SQL.

   ccm-agent writes what it knows of each failover candidate (state, share of the primary's
   hot set, hot blocks it lacks) to the primary's shared memory after every cycle, with
   ccm_report_candidates(), granted to ccm_agent only. The view ccm_candidates shows the last
   report to pg_monitor: psql in an incident, postgres_exporter's custom queries or pgwatch
   see per candidate what `ccm-agent status` shows, and whether the report is stale (older
   than three times the delay within which the agent said its next report was due).

   Nothing that 0.7.0 has changes shape, so a 0.7.0 library serves this catalog's other
   functions; the two new ones fail there with "could not find function" until the node runs
   the 0.8.0 library. Order of a rolling upgrade as before (README, "Upgrading"): the library
   on every node first, then ALTER EXTENSION pg_ccm UPDATE on the primary. Released scripts
   are never edited. */

\echo Use "ALTER EXTENSION pg_ccm UPDATE TO '0.8.0'" to load this file. \quit

CREATE FUNCTION "ccm_report_candidates"(
	"agent" TEXT,
	"next_report_ms" bigint,
	"member" TEXT[],
	"state" TEXT[],
	"coverage" double precision[],
	"missing_blocks" bigint[],
	"hot_blocks" bigint[]
) RETURNS INT
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_report_candidates_wrapper';

CREATE FUNCTION "ccm_candidate_reports"() RETURNS TABLE (
	"member" TEXT,
	"state" TEXT,
	"coverage" double precision,
	"missing_blocks" bigint,
	"hot_blocks" bigint,
	"agent" TEXT,
	"reported_at" timestamp with time zone,
	"stale" bool
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_candidate_reports_wrapper';

CREATE VIEW ccm_candidates AS SELECT * FROM ccm_candidate_reports();
COMMENT ON VIEW ccm_candidates IS 'The active ccm-agent''s last report of each failover candidate (on the primary); stale when older than three times the delay it announced for the next';

REVOKE ALL ON FUNCTION ccm_report_candidates(text, int8, text[], text[], float8[], int8[], int8[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_candidate_reports() FROM PUBLIC;
REVOKE ALL ON ccm_candidates FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ccm_report_candidates(text, int8, text[], text[], float8[], int8[], int8[]) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_candidate_reports() TO pg_monitor, ccm_agent;
GRANT SELECT ON ccm_candidates TO pg_monitor, ccm_agent;
