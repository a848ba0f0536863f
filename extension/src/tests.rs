//! SQL-level tests, run inside a real server by `cargo pgrx test`.
//!
//! The test server is a primary, so ccm_prewarm() is only checked to refuse here. Its
//! standby behaviour and the cross-node behaviour (a cold standby getting warm, replay
//! truncating and dropping relations under a prewarm, failover) are covered by the
//! integration tests in tests/.

use pgrx::prelude::*;

#[pg_schema]
mod tests {
    use ccm_codec::{encode_block_list, HotBlock, RelFork};
    use pgrx::prelude::*;

    fn one_i64(query: &str) -> i64 {
        Spi::get_one::<i64>(query).expect("query failed").expect("NULL result")
    }

    fn bytes(query: &str) -> Vec<u8> {
        Spi::get_one::<Vec<u8>>(query).expect("query failed").expect("NULL result")
    }

    /// A table whose pages stay in shared_buffers (dirty, 1000 rows) and its address.
    fn cached_table(name: &str) -> (RelFork, u32) {
        Spi::run(&format!(
            "CREATE TABLE {name} AS SELECT g AS id, repeat('x', 200) AS pad FROM generate_series(1, 1000) g"
        ))
        .unwrap();
        let spc = one_i64(&format!(
            "SELECT CASE reltablespace WHEN 0 THEN (SELECT oid FROM pg_tablespace WHERE spcname = 'pg_default') ELSE reltablespace END::int8 FROM pg_class WHERE relname = '{name}'"
        ));
        let db = one_i64("SELECT oid::int8 FROM pg_database WHERE datname = current_database()");
        let rel = one_i64(&format!("SELECT pg_relation_filenode('{name}')::int8"));
        let blocks = one_i64(&format!("SELECT pg_relation_size('{name}') / 8192"));
        (RelFork { spc: spc as u32, db: db as u32, rel: rel as u32, fork: 0 }, blocks as u32)
    }

    fn prewarm(list: Vec<u8>) -> (i64, i64, i64, i64) {
        let row = Spi::connect(|client| {
            let table = client
                .select(
                    "SELECT requested, loaded, already_cached, skipped FROM ccm_prewarm($1)",
                    None,
                    &[list.into()],
                )
                .unwrap();
            let row = table.first();
            (
                row.get::<i64>(1).unwrap().unwrap(),
                row.get::<i64>(2).unwrap().unwrap(),
                row.get::<i64>(3).unwrap().unwrap(),
                row.get::<i64>(4).unwrap().unwrap(),
            )
        });
        row
    }

    fn list_of(rel: RelFork, blocks: impl IntoIterator<Item = u32>, usage: u8) -> Vec<u8> {
        let mut hot: Vec<HotBlock> =
            blocks.into_iter().map(|block| HotBlock { addr: rel.block(block), usage }).collect();
        encode_block_list(&mut hot, 0, 0).unwrap()
    }

    fn set_sighup_guc(name: &std::ffi::CStr, value: &std::ffi::CStr) {
        // What a reload of postgresql.conf does; a test cannot reload mid-transaction.
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SIGHUP,
                pg_sys::GucSource::PGC_S_FILE,
            )
        };
    }

    #[pg_test]
    fn status_reports_aurora_columns_and_the_last_scan() {
        set_sighup_guc(c"ccm.usage_threshold", c"0");
        let list = bytes("SELECT ccm_hot_blocks(NULL, NULL, NULL)");
        let listed = one_i64(&format!(
            "SELECT blocks FROM ccm_block_list_info('\\x{}'::bytea)",
            hex(&list)
        ));
        let found = one_i64(&format!(
            "SELECT hot_buffers_found FROM ccm_block_list_info('\\x{}'::bytea)",
            hex(&list)
        ));
        assert!(listed > 0, "a running server has buffers with usage count > 0");
        assert_eq!(listed, found, "without a filter every hot buffer is sent");
        assert_eq!(one_i64("SELECT buffers_sent_last_scan FROM aurora_ccm_status()"), listed);
        assert_eq!(one_i64("SELECT buffers_found_last_scan FROM aurora_ccm_status()"), found);
        assert!(one_i64("SELECT buffers_sent_last_minute FROM aurora_ccm_status()") >= listed);
        assert_eq!(
            one_i64("SELECT current_scan_progress FROM aurora_ccm_status()"),
            one_i64("SELECT setting::int8 FROM pg_settings WHERE name = 'shared_buffers'")
        );
        let result = Spi::get_one::<String>(
            "SELECT pg_get_function_result('aurora_ccm_status()'::regprocedure)",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            result,
            "TABLE(buffers_sent_last_minute bigint, buffers_found_last_minute bigint, \
             buffers_sent_last_scan bigint, buffers_found_last_scan bigint, \
             buffers_sent_current_scan bigint, buffers_found_current_scan bigint, \
             current_scan_progress bigint)"
        );
    }

    #[pg_test]
    fn a_scan_at_another_threshold_leaves_the_status_alone() {
        // The configured threshold (3) counts; the agent's look below it, to fill a
        // standby's unused buffers, must not change what the counters mean.
        Spi::run("CREATE TABLE status_probe AS SELECT g FROM generate_series(1, 20000) g").unwrap();
        Spi::run("SELECT ccm_hot_blocks(NULL, NULL, 3)").unwrap();
        let found = one_i64("SELECT buffers_found_last_scan FROM aurora_ccm_status()");
        let everything = one_i64("SELECT blocks FROM ccm_block_list_info(ccm_hot_blocks(NULL, NULL, 0))");
        assert!(everything > found, "the new table's pages have usage counts of 1 to 3");
        assert_eq!(one_i64("SELECT buffers_found_last_scan FROM aurora_ccm_status()"), found);
        Spi::run("SELECT ccm_hot_blocks_each(ARRAY[NULL]::bytea[], ARRAY[NULL]::int8[], 0)").unwrap();
        assert_eq!(one_i64("SELECT buffers_found_last_scan FROM aurora_ccm_status()"), found);
    }

    #[pg_test(error = "Cluster Cache Manager is disabled")]
    fn status_with_ccm_disabled_is_aurora_error() {
        set_sighup_guc(c"ccm.enabled", c"off");
        Spi::run("SELECT * FROM aurora_ccm_status()").unwrap();
    }

    #[pg_test(error = "Cluster Cache Manager is disabled")]
    fn hot_blocks_with_ccm_disabled_fails() {
        set_sighup_guc(c"ccm.enabled", c"off");
        Spi::run("SELECT ccm_hot_blocks()").unwrap();
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[pg_test]
    fn filter_contains_every_cached_block_of_a_table() {
        let (rel, blocks) = cached_table("filter_t");
        assert!(blocks > 20);
        let filter = bytes("SELECT ccm_buffer_filter()");
        let filter_hex = hex(&filter);
        let missing = one_i64(&format!(
            "SELECT count(*) FROM generate_series(0, {}) b \
             WHERE NOT ccm_filter_contains('\\x{filter_hex}'::bytea, {}, {}, {}, 0::int2, b)",
            blocks - 1,
            rel.spc,
            rel.db,
            rel.rel
        ));
        assert_eq!(missing, 0, "a bloom filter has no false negatives");
        let (bits, hashes, items, fpr) = Spi::connect(|client| {
            let table = client
                .select(
                    "SELECT bits, hashes, items, false_positive_rate FROM ccm_filter_info($1)",
                    None,
                    &[filter.clone().into()],
                )
                .unwrap();
            let row = table.first();
            (
                row.get::<i64>(1).unwrap().unwrap(),
                row.get::<i32>(2).unwrap().unwrap(),
                row.get::<i64>(3).unwrap().unwrap(),
                row.get::<f64>(4).unwrap().unwrap(),
            )
        });
        assert!(items >= i64::from(blocks));
        assert!(bits <= items * 10 + 64, "{bits} bits for {items} items");
        assert_eq!(hashes, 7);
        assert!(fpr > 0.0 && fpr < 0.02, "estimated false-positive rate {fpr}");
    }

    #[pg_test]
    fn hot_blocks_skip_what_the_filter_holds() {
        let (_rel, _blocks) = cached_table("hot_t");
        let everything = one_i64("SELECT blocks FROM ccm_block_list_info(ccm_hot_blocks(NULL, NULL, 0))");
        let missing = one_i64(
            "SELECT blocks FROM ccm_block_list_info(ccm_hot_blocks(ccm_buffer_filter(0.001), NULL, 0))",
        );
        assert!(everything > 100, "{everything}");
        // Only buffers loaded between the two scans, or false positives, may remain.
        assert!(missing * 50 < everything, "{missing} of {everything} still sent");
    }

    #[pg_test]
    fn hot_blocks_keep_the_hottest_when_capped() {
        cached_table("cap_t");
        // Usage counts only fall when the clock sweep runs, which an idle server with free
        // buffers does not do, so the hottest blocks of the first scan are still hottest.
        let all = hex(&bytes("SELECT ccm_hot_blocks(NULL, NULL, 0)"));
        let top = one_i64(&format!("SELECT max(usagecount)::int8 FROM ccm_unpack_block_list('\\x{all}')"));
        let at_top = one_i64(&format!(
            "SELECT count(*) FROM ccm_unpack_block_list('\\x{all}') WHERE usagecount = {top}"
        ));
        assert!(at_top >= 5, "need 5 blocks at the top usage count, have {at_top}");
        let capped = hex(&bytes("SELECT ccm_hot_blocks(NULL, 5, 0)"));
        assert_eq!(one_i64(&format!("SELECT blocks FROM ccm_block_list_info('\\x{capped}')")), 5);
        assert_eq!(
            one_i64(&format!("SELECT min(usagecount)::int8 FROM ccm_unpack_block_list('\\x{capped}')")),
            top
        );
        assert_eq!(one_i64("SELECT blocks FROM ccm_block_list_info(ccm_hot_blocks(NULL, 0, 0))"), 0);
    }

    #[pg_test]
    fn hot_blocks_each_is_one_list_per_filter() {
        cached_table("each_t");
        // The same filter given to ccm_hot_blocks() and to ccm_hot_blocks_each() gets the
        // same list; no filter gets every hot block; each list obeys its own cap. Compared
        // within one statement, so that no buffer is loaded between the scans.
        Spi::run("CREATE TEMP TABLE f AS SELECT ccm_buffer_filter(0.001) AS f").unwrap();
        let compare = "SELECT l[1] = ccm_hot_blocks(f, NULL, 0), l[2] = ccm_hot_blocks(NULL, NULL, 0), \
                              l[3] = ccm_hot_blocks(NULL, 3, 0) \
                       FROM f, LATERAL (SELECT ccm_hot_blocks_each(ARRAY[f, NULL, NULL], \
                                                                   ARRAY[NULL, NULL, 3]::int8[], 0) AS l) e";
        // A first run loads the catalog entries the statement needs: the run compared then
        // touches no buffer between its scans, so their usage counts stay put.
        Spi::get_three::<bool, bool, bool>(compare).unwrap();
        let same = Spi::get_three::<bool, bool, bool>(compare).unwrap();
        assert_eq!(same, (Some(true), Some(true), Some(true)));
        let sizes = Spi::get_three::<i64, i64, i64>(
            "SELECT (ccm_block_list_info(l[1])).blocks, (ccm_block_list_info(l[2])).blocks, \
                    (ccm_block_list_info(l[3])).blocks \
             FROM f, LATERAL (SELECT ccm_hot_blocks_each(ARRAY[f, NULL, NULL], \
                                                         ARRAY[NULL, NULL, 3]::int8[], 0) AS l) e",
        )
        .unwrap();
        let (Some(filtered), Some(everything), Some(capped)) = sizes else { panic!("{sizes:?}") };
        assert!(everything > 100, "{everything}");
        assert!(filtered * 50 < everything, "{filtered} of {everything} still sent");
        assert_eq!(capped, 3);
    }

    #[pg_test(error = "max_blocks has 1 elements, filters has 2")]
    fn hot_blocks_each_wants_one_cap_per_filter() {
        Spi::run("SELECT ccm_hot_blocks_each(ARRAY[NULL, NULL]::bytea[], ARRAY[1]::int8[])").unwrap();
    }

    #[pg_test(error = "invalid number of filters: 65")]
    fn hot_blocks_each_serves_at_most_64_standbys() {
        Spi::run(
            "SELECT ccm_hot_blocks_each(array_fill(NULL::bytea, ARRAY[65]), array_fill(NULL::int8, ARRAY[65]))",
        )
        .unwrap();
    }

    #[pg_test]
    fn wal_source_of_a_primary_is_its_timeline() {
        let row = Spi::get_two::<bool, i32>("SELECT in_recovery, timeline FROM ccm_wal_source()").unwrap();
        assert_eq!(row, (Some(false), Some(1)));
        assert_eq!(one_i64("SELECT count(sender_host) FROM ccm_wal_source()"), 0);
    }

    #[pg_test]
    fn unpacked_list_matches_hot_buffers() {
        cached_table("unpack_t");
        let unpacked = one_i64(
            "SELECT count(*) FROM ccm_unpack_block_list(ccm_hot_blocks(NULL, NULL, 0)) u \
             JOIN pg_class c ON c.relfilenode = u.relfilenode WHERE c.relname = 'unpack_t'",
        );
        let shown = one_i64(
            "SELECT count(*) FROM ccm_hot_buffers(NULL, 0) h \
             JOIN pg_class c ON c.relfilenode = h.relfilenode WHERE c.relname = 'unpack_t'",
        );
        assert!(unpacked > 20);
        assert_eq!(unpacked, shown);
    }

    // ccm_prewarm's behaviour on a standby (counts, usage counts, skips, bad lists, replay's
    // locks) is tested on a real standby: tests/integration/test_prewarm_sql.py.

    #[pg_test(error = "recovery is not in progress")]
    fn prewarm_refuses_to_run_on_a_primary() {
        let (rel, blocks) = cached_table("primary_t");
        prewarm(list_of(rel, 0..blocks, 5));
    }

    #[pg_test(error = "recovery is not in progress")]
    fn os_prefetch_refuses_to_run_on_a_primary() {
        let (rel, blocks) = cached_table("os_primary_t");
        Spi::connect(|client| {
            client.select("SELECT * FROM ccm_os_prefetch($1)", None, &[list_of(rel, 0..blocks, 0).into()]).map(|_| ())
        })
        .unwrap();
    }

    #[pg_test(error = "max_blocks must be between 1 and 1048576: 0")]
    fn os_cached_blocks_bounds_its_list() {
        Spi::run("SELECT * FROM ccm_os_cached_blocks(0, 0, 0, -1, 0, 10)").unwrap();
    }

    #[pg_test(error = "max_files must be between 1 and 100000: 100001")]
    fn os_cached_blocks_bounds_its_files() {
        Spi::run("SELECT * FROM ccm_os_cached_blocks(0, 0, 0, -1, 10, 100001)").unwrap();
    }

    #[pg_test]
    fn os_cached_blocks_walks_every_file_once_in_steps() {
        // Which pages the kernel caches can change at any time; the walk itself cannot: each
        // step moves the cursor forward, examines at most max_files files, and the steps
        // together examine what one call examines.
        let step = "SELECT encode(list, 'hex'), last_spc::int8, last_db::int8, last_rel::int8, last_block, complete, files, in_play \
                    FROM ccm_os_cached_blocks($1::int8::oid, $2::int8::oid, $3::int8::oid, $4, $5, $6)";
        let walk = |max_files: i32| {
            let (mut cursor, mut files, mut calls) = ((0i64, 0i64, 0i64, -1i64), 0i64, 0);
            loop {
                let (list, next, complete, stepped, in_play) = Spi::connect(|client| {
                    let args = [cursor.0.into(), cursor.1.into(), cursor.2.into(), cursor.3.into(), 1_048_576i64.into(), max_files.into()];
                    let row = client.select(step, None, &args).unwrap().first();
                    let at = |i| row.get::<i64>(i).unwrap().unwrap();
                    (
                        row.get::<String>(1).unwrap().unwrap(),
                        (at(2), at(3), at(4), at(5)),
                        row.get::<bool>(6).unwrap().unwrap(),
                        i64::from(row.get::<i32>(7).unwrap().unwrap()),
                        row.get::<bool>(8).unwrap().unwrap(),
                    )
                });
                assert!(in_play, "the test server reads through the page cache");
                assert!(stepped <= i64::from(max_files));
                assert!(complete || next > cursor, "{next:?} after {cursor:?}");
                one_i64(&format!("SELECT blocks FROM ccm_block_list_info('\\x{list}'::bytea)"));
                (cursor, files, calls) = (next, files + stepped, calls + 1);
                if complete {
                    return (files, calls);
                }
            }
        };
        Spi::run("CREATE TABLE os_walk_t AS SELECT g FROM generate_series(1, 100000) g").unwrap();
        Spi::run("CHECKPOINT").unwrap();
        let (all, one_call) = walk(100_000);
        assert_eq!(one_call, 1);
        assert!(all > 100, "a cluster has hundreds of relation files: {all}");
        let (stepped, calls) = walk(7);
        // Other sessions (autovacuum) may give a relation its first block meanwhile.
        assert!((stepped - all).abs() <= 10, "{stepped} files in steps, {all} in one call");
        assert!(calls >= all / 7, "{calls} calls for {all} files");
    }

    #[pg_test(error = "invalid pg_ccm filter")]
    fn hot_blocks_reject_a_corrupt_filter() {
        let mut filter = bytes("SELECT ccm_buffer_filter()");
        filter[4] = 99; // version
        Spi::connect(|client| {
            client.select("SELECT ccm_hot_blocks($1)", None, &[filter.into()]).map(|_| ())
        })
        .unwrap();
    }

    #[pg_test(error = "invalid pg_ccm filter")]
    fn filter_info_rejects_garbage() {
        Spi::run("SELECT * FROM ccm_filter_info('\\x00010203'::bytea)").unwrap();
    }

    #[pg_test(error = "invalid false_positive_rate: 0")]
    fn filter_rejects_a_zero_false_positive_rate() {
        Spi::run("SELECT ccm_buffer_filter(0)").unwrap();
    }

    #[pg_test(error = "invalid fork number: 9")]
    fn filter_contains_rejects_a_bad_fork() {
        Spi::run("SELECT ccm_filter_contains(ccm_buffer_filter(), 1663, 1, 1, 9::int2, 0)").unwrap();
    }

    #[pg_test(error = "invalid max_blocks: -1")]
    fn hot_blocks_reject_a_negative_cap() {
        Spi::run("SELECT ccm_hot_blocks(NULL, -1)").unwrap();
    }

    #[pg_test(error = "invalid usage_threshold: 9")]
    fn hot_blocks_reject_a_bad_threshold() {
        Spi::run("SELECT ccm_hot_blocks(NULL, NULL, 9)").unwrap();
    }

    #[pg_test(error = "permission denied for function ccm_prewarm")]
    fn public_cannot_prewarm() {
        Spi::run("CREATE ROLE ccm_test_nobody").unwrap();
        Spi::run("SET ROLE ccm_test_nobody").unwrap();
        Spi::run("SELECT * FROM ccm_prewarm(NULL)").unwrap();
    }

    #[pg_test(error = "permission denied for function aurora_ccm_status")]
    fn public_cannot_read_status() {
        Spi::run("CREATE ROLE ccm_test_public").unwrap();
        Spi::run("SET ROLE ccm_test_public").unwrap();
        Spi::run("SELECT * FROM aurora_ccm_status()").unwrap();
    }

    /// One answer of ccm_buffer_changes().
    struct FeedAnswer {
        seq: i64,
        reset_reason: Option<String>,
        buffers: i64,
        sweeps: i64,
        visited: i64,
        added: Vec<HotBlock>,
        removed: Vec<HotBlock>,
        present: Option<Vec<HotBlock>>,
        colder_added: Option<Vec<HotBlock>>,
        colder_removed: Option<Vec<HotBlock>>,
    }

    fn decoded(list: Option<Vec<u8>>) -> Option<Vec<HotBlock>> {
        list.map(|bytes| ccm_codec::BlockList::decode(&bytes).unwrap().iter().collect())
    }

    fn feed(subscriber: i64, after: i64, threshold: i32, max_buffers: Option<i64>, probe: Option<Vec<u8>>) -> FeedAnswer {
        feed_colder(subscriber, after, threshold, max_buffers, probe, false)
    }

    fn feed_colder(
        subscriber: i64,
        after: i64,
        threshold: i32,
        max_buffers: Option<i64>,
        probe: Option<Vec<u8>>,
        colder: bool,
    ) -> FeedAnswer {
        Spi::connect(|client| {
            let table = client
                .select(
                    "SELECT seq, reset, reset_reason, buffers, sweeps, visited, added, removed, present, \
                     colder_added, colder_removed FROM ccm_buffer_changes($1, $2, $3, $4, $5, $6)",
                    None,
                    &[
                        subscriber.into(),
                        after.into(),
                        threshold.into(),
                        max_buffers.into(),
                        probe.into(),
                        colder.into(),
                    ],
                )
                .unwrap();
            let row = table.first();
            let reset: bool = row.get(2).unwrap().unwrap();
            let reset_reason: Option<String> = row.get(3).unwrap();
            assert_eq!(reset, reset_reason.is_some(), "a reset says why, and only a reset");
            FeedAnswer {
                seq: row.get(1).unwrap().unwrap(),
                reset_reason,
                buffers: row.get(4).unwrap().unwrap(),
                sweeps: row.get(5).unwrap().unwrap(),
                visited: row.get(6).unwrap().unwrap(),
                added: decoded(row.get(7).unwrap()).unwrap(),
                removed: decoded(row.get(8).unwrap()).unwrap(),
                present: decoded(row.get(9).unwrap()),
                colder_added: decoded(row.get(10).unwrap()),
                colder_removed: decoded(row.get(11).unwrap()),
            }
        })
    }

    fn blocks_of(list: &[HotBlock], rel: RelFork) -> Vec<u32> {
        list.iter().filter(|b| b.addr.rel_fork() == rel).map(|b| b.addr.block).collect()
    }

    /// The whole life of a feed, in one test: tests run in parallel sessions of one server,
    /// and two subscribers would reset each other.
    #[pg_test]
    fn change_feed_reports_what_changed() {
        let me = 0x5eed_0001;
        let first = feed(me, 0, -1, None, None);
        assert_eq!(first.reset_reason.as_deref(), Some("new subscriber"));
        assert_eq!(first.visited, first.buffers, "no max_buffers: one whole sweep");
        assert_eq!(first.sweeps, 1);

        // A new table's pages are cached: the next sweep adds them, and the probe (answered
        // after the sweep) finds them reported; a block past its end is not held.
        let (rel, blocks) = cached_table("feed_probe");
        assert!(blocks > 10);
        let probe = list_of(rel, 0..=blocks, 1);
        // Cached but not yet swept (max_buffers 0): not confirmed, since nothing would
        // report its eviction.
        let unswept = feed(me, first.seq, -1, Some(0), Some(probe.clone()));
        assert_eq!((unswept.reset_reason.as_deref(), unswept.visited), (None, 0));
        assert!(blocks_of(unswept.present.as_ref().unwrap(), rel).is_empty());
        let second = feed(me, unswept.seq, -1, None, Some(probe.clone()));
        assert_eq!(second.reset_reason, None);
        assert_eq!(blocks_of(&second.added, rel), (0..blocks).collect::<Vec<_>>());
        assert_eq!(blocks_of(second.present.as_ref().unwrap(), rel), (0..blocks).collect::<Vec<_>>());

        // Nothing changed for them: not added again.
        let third = feed(me, second.seq, -1, None, None);
        assert!(blocks_of(&third.added, rel).is_empty());
        assert_eq!(third.present, None);

        // TRUNCATE of a table created in this transaction drops its buffers at once
        // (DropRelationBuffers): the next sweep reports them removed, and the probe no
        // longer finds them.
        Spi::run("TRUNCATE feed_probe").unwrap();
        let fourth = feed(me, third.seq, -1, None, Some(probe));
        assert_eq!(blocks_of(&fourth.removed, rel), (0..blocks).collect::<Vec<_>>());
        assert!(blocks_of(fourth.present.as_ref().unwrap(), rel).is_empty());

        // An answer the caller did not apply (it passes an older seq): start over.
        let stale = feed(me, third.seq, -1, None, None);
        assert_eq!(stale.reset_reason.as_deref(), Some("sequence mismatch"));
        assert!(stale.seq > fourth.seq, "seqs are never reused");

        // A bounded sweep: half the buffers per call, a full sweep every second call.
        let half = stale.buffers / 2;
        let reset = feed(me, stale.seq + 1, -1, Some(half), None);
        assert_eq!(reset.reset_reason.as_deref(), Some("sequence mismatch"));
        assert_eq!((reset.visited, reset.sweeps), (half, 0));
        let rest = feed(me, reset.seq, -1, Some(stale.buffers - half), None);
        assert_eq!((rest.visited, rest.sweeps), (stale.buffers - half, 1));

        // Another threshold, another subscriber: start over.
        let hot = feed(me, rest.seq, 0, Some(0), None);
        assert_eq!(hot.reset_reason.as_deref(), Some("threshold changed"));
        let other = feed(me + 1, hot.seq, 4, Some(0), None);
        assert_eq!(other.reset_reason.as_deref(), Some("new subscriber"));
        assert_eq!((other.colder_added.is_none(), other.colder_removed.is_none()), (true, true));

        // The colder set: a table just written through a bulk-write ring holds usage count 1,
        // below a threshold of 4. Asking for it starts over.
        let (rel, blocks) = cached_table("feed_colder");
        let all: Vec<u32> = (0..blocks).collect();
        let colder = feed_colder(me + 1, other.seq, 4, None, None, true);
        assert_eq!(colder.reset_reason.as_deref(), Some("colder changed"));
        assert!(blocks_of(&colder.added, rel).is_empty());
        let cold = colder.colder_added.as_ref().unwrap();
        assert_eq!(blocks_of(cold, rel), all);
        assert!(cold.iter().all(|b| b.usage <= 4), "colder blocks are at or below the threshold");
        // Read five times, the blocks reach usage 5: they move to the hot set.
        for _ in 0..5 {
            Spi::run("SELECT count(*) FROM feed_colder").unwrap();
        }
        let warmed = feed_colder(me + 1, colder.seq, 4, None, None, true);
        assert_eq!(warmed.reset_reason, None);
        assert_eq!(blocks_of(&warmed.added, rel), all);
        assert_eq!(blocks_of(warmed.colder_removed.as_ref().unwrap(), rel), all);
        assert!(blocks_of(warmed.colder_added.as_ref().unwrap(), rel).is_empty());
        // Dropped from the buffers, they leave the hot set and do not show up as colder.
        Spi::run("TRUNCATE feed_colder").unwrap();
        let gone = feed_colder(me + 1, warmed.seq, 4, None, None, true);
        assert_eq!(blocks_of(&gone.removed, rel), all);
        assert!(blocks_of(gone.colder_added.as_ref().unwrap(), rel).is_empty());
        // Without colder again: start over, and no colder lists.
        let plain = feed(me + 1, gone.seq, 4, Some(0), None);
        assert_eq!(plain.reset_reason.as_deref(), Some("colder changed"));
        assert_eq!(plain.colder_added.is_none(), true);
    }

    #[pg_test(error = "invalid subscriber: 0")]
    fn change_feed_wants_a_subscriber() {
        Spi::run("SELECT ccm_buffer_changes(0, 0)").unwrap();
    }

    #[pg_test(error = "invalid max_buffers: -1")]
    fn change_feed_rejects_a_negative_budget() {
        Spi::run("SELECT ccm_buffer_changes(1, 0, -1, -1)").unwrap();
    }

    #[pg_test(error = "invalid usage_threshold: -2")]
    fn change_feed_rejects_a_bad_threshold() {
        Spi::run("SELECT ccm_buffer_changes(1, 0, -2)").unwrap();
    }

    #[pg_test(error = "invalid pg_ccm block list")]
    fn change_feed_rejects_a_corrupt_probe() {
        Spi::run("SELECT ccm_buffer_changes(1, 0, -1, 0, '\\x43434d4201'::bytea)").unwrap();
    }

    #[pg_test]
    fn monitor_and_agent_roles_get_their_functions() {
        Spi::run("CREATE ROLE ccm_test_monitor IN ROLE pg_monitor").unwrap();
        Spi::run("CREATE ROLE ccm_test_agent IN ROLE ccm_agent").unwrap();
        let allowed = |role: &str, function: &str| {
            Spi::get_one::<bool>(&format!(
                "SELECT has_function_privilege('{role}', '{function}', 'EXECUTE')"
            ))
            .unwrap()
            .unwrap()
        };
        assert!(allowed("ccm_test_monitor", "aurora_ccm_status()"));
        assert!(allowed("ccm_test_monitor", "ccm_hot_buffers(bytea, int4)"));
        assert!(!allowed("ccm_test_monitor", "ccm_prewarm(bytea)"));
        assert!(!allowed("ccm_test_monitor", "ccm_hot_blocks(bytea, int8, int4)"));
        assert!(allowed("ccm_test_monitor", "ccm_wal_source()"));
        assert!(!allowed("ccm_test_monitor", "ccm_hot_blocks_each(bytea[], int8[], int4)"));
        assert!(!allowed("ccm_test_monitor", "ccm_buffer_changes(int8, int8, int4, int8, bytea, bool)"));
        assert!(allowed("ccm_test_monitor", "ccm_library_version()"));
        assert!(!allowed("public", "ccm_library_version()"));
        for function in [
            "ccm_buffer_filter(float8)",
            "ccm_hot_blocks(bytea, int8, int4)",
            "ccm_hot_blocks_each(bytea[], int8[], int4)",
            "ccm_wal_source()",
            "ccm_prewarm(bytea)",
            "ccm_buffer_changes(int8, int8, int4, int8, bytea, bool)",
            "aurora_ccm_status()",
            "ccm_library_version()",
        ] {
            assert!(allowed("ccm_test_agent", function), "{function}");
        }
        let superuser = Spi::get_one::<bool>(
            "SELECT rolsuper FROM pg_roles WHERE rolname = 'ccm_agent'",
        );
        assert_eq!(superuser, Ok(Some(false)));
    }

    #[pg_test]
    fn library_version_is_the_crate_version() {
        let version = env!("CARGO_PKG_VERSION");
        assert_eq!(Spi::get_one::<String>("SELECT ccm_library_version()"), Ok(Some(version.into())));
        assert_eq!(Spi::get_one::<String>("SHOW ccm.library_version"), Ok(Some(version.into())));
    }

    /// Read-only, as server_version is.
    #[pg_test(error = "parameter \"ccm.library_version\" cannot be changed")]
    fn library_version_cannot_be_set() {
        Spi::run("SET ccm.library_version = '9.9.9'").unwrap();
    }

    #[pg_test]
    fn wal_cache_functions_without_logical_slots() {
        // The test server runs with wal_level = replica: no logical slot can exist.
        assert_eq!(one_i64("SELECT count(*) FROM aurora_stat_logical_wal_cache()"), 0);
        assert_eq!(
            Spi::get_one::<String>("SELECT aurora_stat_reset_wal_cache('missing')"),
            Ok(Some("Replication slot not found. Please try again.".into()))
        );
        assert_eq!(
            Spi::get_one::<String>("SELECT aurora_stat_reset_wal_cache(NULL)"),
            Ok(Some("Reset the logical wal cache counter.".into()))
        );
        // The default cache: 2048 pages of 8 kB.
        assert_eq!(Spi::get_one::<String>("SHOW ccm.logical_wal_cache"), Ok(Some("16MB".into())));
        assert_eq!(one_i64("SELECT size_blocks FROM ccm_logical_wal_cache_status()"), 2048);
        let monitor = |function: &str| {
            Spi::get_one::<bool>(&format!(
                "SELECT has_function_privilege('pg_monitor', '{function}', 'EXECUTE')"
            ))
            .unwrap()
            .unwrap()
        };
        assert!(monitor("aurora_stat_logical_wal_cache()"));
        assert!(monitor("get_oldest_wal_cache_ptr()"));
        assert!(!monitor("aurora_stat_reset_wal_cache(text)"));
    }
}
