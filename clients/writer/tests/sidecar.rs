//! The sidecar: many tables in one process from a TOML file, a failing table beside healthy
//! ones, shared facts and control tables, and `status`.

mod common;

use common::{Lab, bronze_rows, query, source_rows, utf8};
use mssql_cdc_flight::sim::Faults;
use mssql_cdc_writer::sidecar::{self, SidecarConfig};
use mssql_cdc_writer::tables;

fn write_config(lab: &Lab, tables: &[(&str, &str)]) -> std::path::PathBuf {
    let mut text = format!(
        "server = \"{}\"\nfacts = \"{}\"\ncontrol = \"{}\"\ncheckpoints = \"{}\"\ngranularity = \"minute\"\n",
        lab.url,
        lab.lake("facts"),
        lab.lake("control"),
        lab.dir.path().join("checkpoints").display()
    );
    for (table, app_id) in tables {
        text.push_str(&format!(
            "\n[[tables]]\ntable = \"{table}\"\ntarget = \"{}\"\napp_id = \"{app_id}\"\nmax_commits = 100\n",
            lab.lake(&format!("bronze_{app_id}"))
        ));
    }
    let path = lab.dir.path().join("sidecar.toml");
    std::fs::write(&path, text).expect("config");
    path
}

async fn keys_in(lab: &Lab, app_id: &str, key: &str) -> usize {
    let batches = query(
        &lab.lake(&format!("bronze_{app_id}")),
        &format!("SELECT COUNT({key}) FROM t"),
    )
    .await;
    let counts = batches[0]
        .column(0)
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .expect("count")
        .clone();
    counts.value(0) as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_table_does_not_stop_the_others() {
    let lab = Lab::new().await;
    lab.workload(41, 250);
    let path = write_config(
        &lab,
        &[
            ("dbo.orders", "orders"),
            ("dbo.customers", "customers"),
            ("dbo.missing", "missing"),
        ],
    );
    let config = SidecarConfig::load(&path).expect("config");
    let results = sidecar::run_available_now(&config).await;
    let by_table: std::collections::HashMap<String, bool> = results
        .iter()
        .map(|(table, result)| (table.clone(), result.is_ok()))
        .collect();
    assert!(by_table["dbo.orders"]);
    assert!(by_table["dbo.customers"]);
    assert!(
        !by_table["dbo.missing"],
        "an unknown table fails after its retries"
    );
    let missing = results
        .iter()
        .find(|(table, _)| table == "dbo.missing")
        .expect("missing")
        .1
        .as_ref()
        .expect_err("error");
    assert!(missing.to_string().contains("dbo.missing"), "{missing}");
    assert_eq!(
        keys_in(&lab, "orders", "order_id").await,
        lab.committed_of("dbo.orders").len()
    );
    assert_eq!(
        keys_in(&lab, "customers", "customer_id").await,
        lab.committed_of("dbo.customers").len()
    );
    // Shared facts and control tables hold both tables.
    let apps = query(
        &lab.lake("facts"),
        "SELECT DISTINCT app_id FROM t ORDER BY app_id",
    )
    .await;
    let names: Vec<String> = (0..apps[0].num_rows())
        .map(|row| utf8(apps[0].column(0)).value(row).to_string())
        .collect();
    assert_eq!(names, ["customers", "orders"]);
    let statuses = sidecar::status(&config).await.expect("status");
    assert_eq!(statuses.len(), 3);
    for status in &statuses[..2] {
        assert!(matches!(status.last_batch, Some((_, true))), "{status:?}");
        assert!(status.verdict.is_some(), "{status:?}");
        assert!(status.lag_seconds.is_some());
    }
    assert_eq!(statuses[2].last_batch, None);
    assert_eq!(statuses[2].verdict, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sidecar_files_are_refused_with_the_reason() {
    let lab = Lab::new().await;
    let path = write_config(&lab, &[("dbo.orders", "same"), ("dbo.customers", "same")]);
    let error = SidecarConfig::load(&path).expect_err("duplicate app id");
    assert!(error.to_string().contains("app_id 'same'"), "{error}");
    let text = std::fs::read_to_string(&path)
        .expect("read")
        .replace("granularity", "granularty");
    std::fs::write(&path, text).expect("write");
    let error = SidecarConfig::load(&path).expect_err("unknown key");
    assert!(error.to_string().contains("granularty"), "{error}");
    let path = write_config(&lab, &[("dbo.orders", "orders")]);
    let text = std::fs::read_to_string(&path).expect("read");
    for (setting, name) in [
        ("maintenance_minutes = -1.0\n", "maintenance_minutes"),
        ("vacuum_retention_hours = 0.0\n", "vacuum_retention_hours"),
        ("table_slots = 0\n", "table_slots"),
        ("table_slots = 129\n", "table_slots"),
    ] {
        std::fs::write(&path, format!("{setting}{text}")).expect("write");
        let error = SidecarConfig::load(&path).expect_err(setting);
        assert!(error.to_string().contains(name), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintain_compacts_every_table_of_a_sidecar_whose_checkpoints_live_beside_the_lake() {
    let lab = Lab::new().await;
    let path = write_config(&lab, &[("dbo.orders", "orders")]);
    // No `checkpoints`: they are kept beside the facts table.
    let text = std::fs::read_to_string(&path).expect("read");
    let text: String = text
        .lines()
        .filter(|line| !line.starts_with("checkpoints"))
        .map(|line| format!("{line}\n"))
        .collect();
    std::fs::write(&path, text.replace("max_commits = 100", "max_commits = 5")).expect("write");
    let config = SidecarConfig::load(&path).expect("config");
    lab.workload(81, 60);
    for (table, result) in sidecar::run_available_now(&config).await {
        assert!(
            result.expect(&table).len() >= 10,
            "{table}: batches of 5 commits"
        );
    }
    let checkpoint = std::path::Path::new(&lab.lake("_checkpoints")).join("orders");
    assert!(
        checkpoint.join("commits").is_dir(),
        "the checkpoint is beside the facts"
    );
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
        .args(["maintain", "--min-files", "4", "--config"])
        .arg(&path)
        .output()
        .expect("maintain");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for kind in ["facts", "bronze"] {
        let line = stdout
            .lines()
            .find(|line| line.split_whitespace().nth(1) == Some(kind))
            .unwrap_or_else(|| panic!("a line for {kind}: {stdout}"));
        let figures: Vec<&str> = line.split_whitespace().collect();
        let (before, after): (usize, usize) = (
            figures[2].parse().expect("n"),
            figures[3].parse().expect("n"),
        );
        assert!(before >= 10 && after == 1, "{kind} compacted: {line}");
    }
    assert!(
        stdout.contains("(no table yet)"),
        "the plans table was never created: {stdout}"
    );
    assert_eq!(bronze_rows(&lab).await.expect("bronze"), lab.committed());
    let status = sidecar::status(&config).await.expect("status");
    assert!(
        status[0]
            .last_batch
            .is_some_and(|(id, committed)| id >= 9 && committed)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_service_opens_pauses_and_resumes_a_snapshot_the_sidecar_reads() {
    use mssql_cdc_writer::admin::{self, Request};
    use mssql_cdc_writer::snapshot::SnapshotMode;

    let lab = Lab::new().await;
    lab.workload(71, 200);
    let path = write_config(&lab, &[("dbo.orders", "orders")]);
    let mut config = SidecarConfig::load(&path).expect("config");
    config.poll_seconds = 0.2;
    config.tables[0].chunk_rows = Some(20);
    config.admin_listen = Some("127.0.0.1:0".into());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let server = admin::AdminServer::bind(&config)
        .await
        .expect("bind")
        .expect("admin_listen is set");
    let url = format!("http://{}", server.local_addr().expect("address"));
    tokio::spawn(server.serve(stopped.clone()));
    let running = tokio::spawn({
        let config = config.clone();
        async move { sidecar::run_continuous(&config, stopped).await }
    });
    let call = |request: Request| {
        let url = url.clone();
        async move { admin::call(&url, &Default::default(), "dbo.orders", request).await }
    };
    // The stream's first batch creates the facts table; until then status has no lake.
    let mut state = None;
    for _ in 0..150 {
        if let Ok(answer) = call(Request::Status).await {
            state = Some(answer);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_eq!(state.expect("status answers").status.state, "no_snapshot");
    let unknown = admin::call(&url, &Default::default(), "dbo.nowhere", Request::Status)
        .await
        .expect_err("not in the file");
    assert!(unknown.to_string().contains("dbo.nowhere"), "{unknown}");

    let opened = call(Request::Open(SnapshotMode::Chunked, false))
        .await
        .expect("open");
    assert_eq!(opened.mode.as_deref(), Some("chunked"));
    let paused = call(Request::Pause(Some("load test".into())))
        .await
        .expect("pause");
    assert!(paused.status.paused, "{paused:?}");
    // The sidecar finishes at most the wave it was reading, then holds.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let held = call(Request::Status).await.expect("status");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let still = call(Request::Status).await.expect("status");
    assert_eq!(held.status.state, "paused", "{held:?}");
    assert!(
        held.status
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("load test")
    );
    assert_eq!(
        held.status.chunks_done, still.status.chunks_done,
        "no wave while paused"
    );
    assert!(
        held.status
            .chunks_total
            .is_some_and(|total| held.status.chunks_done < total),
        "{held:?}"
    );

    let resumed = call(Request::Resume).await.expect("resume");
    assert!(!resumed.status.paused);
    let mut done = None;
    for _ in 0..300 {
        let answer = call(Request::Status).await.expect("status");
        if answer.status.done {
            done = Some(answer);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let done = done.expect("the sidecar finishes the snapshot after resume");
    // The CLI reaches the same service with --admin and needs only the table.
    let cli = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
                .args([
                    "snapshot",
                    "status",
                    "--admin",
                    &url,
                    "--table",
                    "dbo.orders",
                ])
                .output()
                .expect("run")
        }
    })
    .await
    .expect("join");
    assert!(
        cli.status.success(),
        "{}",
        String::from_utf8_lossy(&cli.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&cli.stdout).expect("JSON");
    assert_eq!(printed["state"], "done", "{printed}");
    assert_eq!(
        printed["snapshot"],
        serde_json::json!(opened.status.snapshot.map(|s| s.to_string()))
    );
    assert_eq!(Some(done.status.chunks_done), done.status.chunks_total);
    let snapshot = opened.status.snapshot.expect("S");
    let rows = query(
        &lab.lake("bronze_orders"),
        &format!(
            "SELECT COUNT(*), COUNT(DISTINCT order_id) FROM t WHERE _operation = 0 AND _snapshot = '{snapshot}'"
        ),
    )
    .await;
    let counts = rows[0]
        .column(0)
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .expect("count")
        .value(0);
    let distinct = rows[0]
        .column(1)
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .expect("count")
        .value(0);
    assert_eq!(counts, distinct, "no snapshot row twice");
    assert_eq!(
        counts as usize,
        source_rows(&lab).await.len(),
        "every current row"
    );
    stop.send(true).expect("stop");
    running.await.expect("sidecar stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_service_answers_only_calls_carrying_its_token_over_tls() {
    use mssql_cdc_writer::admin::{self, AdminAccess, AdminToken, Request};
    use mssql_cdc_writer::snapshot::SnapshotMode;

    let lab = Lab::new().await;
    lab.workload(73, 100);
    let path = write_config(&lab, &[("dbo.orders", "orders")]);
    let mut config = SidecarConfig::load(&path).expect("config");
    let file = |name: &str, text: &str| {
        let path = lab.dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path
    };
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("certificate");
    let token = "s3cret-admin-token-0123456789";
    config.admin_token_file = Some(file("admin.token", &format!("{token}\n")));
    config.admin_tls_cert = Some(file("admin.pem", &certified.cert.pem()));
    config.admin_tls_key = Some(file("admin.key", &certified.signing_key.serialize_pem()));

    // An address other than loopback is refused without a token, before anything listens.
    let mut open_to_all = config.clone();
    open_to_all.admin_listen = Some("0.0.0.0:0".into());
    open_to_all.admin_token_file = None;
    let refused = admin::AdminServer::bind(&open_to_all)
        .await
        .err()
        .expect("no token on 0.0.0.0");
    assert!(
        refused.to_string().contains("admin_token_file"),
        "{refused}"
    );
    let mut short = config.clone();
    short.admin_listen = Some("127.0.0.1:0".into());
    short.admin_token_file = Some(file("short.token", "abc"));
    let refused = admin::AdminServer::bind(&short)
        .await
        .err()
        .expect("a short token");
    assert!(refused.to_string().contains("16 characters"), "{refused}");

    config.admin_listen = Some("127.0.0.1:0".into());
    let server = admin::AdminServer::bind(&config)
        .await
        .expect("bind")
        .expect("admin_listen is set");
    let port = server.local_addr().expect("address").port();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(server.serve(stopped));
    let url = format!("https://localhost:{port}");
    let ca = certified.cert.pem().into_bytes();
    let access = |token: Option<&str>| AdminAccess {
        token: token.map(|text| AdminToken::new(text).expect("token")),
        ca_certificate: Some(ca.clone()),
    };
    let open = |access: AdminAccess| {
        let url = url.clone();
        async move {
            admin::call(
                &url,
                &access,
                "dbo.orders",
                Request::Open(SnapshotMode::Chunked, false),
            )
            .await
        }
    };
    let facts = mssql_cdc_writer::tables::table_url(&lab.lake("facts")).expect("url");
    let nothing_recorded = || async {
        mssql_cdc_writer::tables::open(&facts)
            .await
            .expect("open")
            .is_none()
    };

    let missing = open(access(None)).await.expect_err("no token");
    assert!(
        missing.to_string().contains("a bearer token is required")
            && missing.to_string().contains("--admin-token-file"),
        "{missing}"
    );
    let wrong = open(access(Some("another-token-0123456789")))
        .await
        .expect_err("wrong token");
    assert!(wrong.to_string().contains("does not match"), "{wrong}");
    // The same length, one character off.
    let near = format!("{}X", &token[..token.len() - 1]);
    assert!(open(access(Some(&near))).await.is_err());
    assert!(nothing_recorded().await, "a refused call wrote to the lake");
    let plaintext = admin::call(
        &format!("http://localhost:{port}"),
        &AdminAccess {
            token: Some(AdminToken::new(token).expect("token")),
            ca_certificate: None,
        },
        "dbo.orders",
        Request::Status,
    )
    .await;
    assert!(plaintext.is_err(), "plaintext reached a TLS service");
    assert!(nothing_recorded().await);

    let opened = open(access(Some(token)))
        .await
        .expect("open with the token");
    assert_eq!(opened.mode.as_deref(), Some("chunked"));
    assert_eq!(opened.status.state, "open", "{opened:?}");

    // The CLI passes the token file and the CA.
    let cli = |with_token: bool| {
        let mut args = vec![
            "snapshot".to_string(),
            "status".into(),
            "--admin".into(),
            url.clone(),
            "--admin-ca".into(),
            config
                .admin_tls_cert
                .as_ref()
                .expect("cert")
                .display()
                .to_string(),
            "--table".into(),
            "dbo.orders".into(),
        ];
        if with_token {
            args.push("--admin-token-file".into());
            args.push(
                config
                    .admin_token_file
                    .as_ref()
                    .expect("token")
                    .display()
                    .to_string(),
            );
        }
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
                .args(args)
                .env_remove("MSSQL_CDC_WRITER_ADMIN_TOKEN_FILE")
                .output()
                .expect("run")
        })
    };
    let refused = cli(false).await.expect("join");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("a bearer token is required"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let answered = cli(true).await.expect("join");
    assert!(
        answered.status.success(),
        "{}",
        String::from_utf8_lossy(&answered.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&answered.stdout).expect("JSON");
    assert_eq!(printed["state"], "open", "{printed}");
    let _ = stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuous_table_whose_stream_fails_is_retried_and_catches_up() {
    let lab = Lab::new().await;
    lab.workload(43, 150);
    // The first change read breaks after a few rows, as a dropped connection would.
    lab.db.set_faults(Faults {
        drop_connection_after_rows: Some(5),
        ..Faults::default()
    });
    let path = write_config(&lab, &[("dbo.orders", "orders")]);
    let mut config = SidecarConfig::load(&path).expect("config");
    config.poll_seconds = 0.2;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move { sidecar::run_continuous(&config, stopped).await });
    let mut caught_up = false;
    for _ in 0..300 {
        if bronze_rows(&lab).await.as_deref() == Some(lab.committed().as_slice()) {
            caught_up = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        caught_up,
        "the table's stream failed once and was never retried"
    );
    stop.send(true).expect("stop");
    tokio::time::timeout(std::time::Duration::from_secs(30), running)
        .await
        .expect("the sidecar stops after its batch and wave in flight")
        .expect("join");
}

/// Whether bronze of both tables and silver of orders hold what the source does.
async fn both_tables_caught_up(lab: &Lab) -> bool {
    let silver = lab.lake("silver_orders");
    let silver_open = tables::open(&tables::table_url(&silver).expect("url"))
        .await
        .expect("open")
        .is_some();
    bronze_rows(lab).await.as_deref() == Some(lab.committed().as_slice())
        && tables::open(&tables::table_url(&lab.lake("bronze_customers")).expect("url"))
            .await
            .expect("open")
            .is_some()
        && keys_in(lab, "customers", "customer_id").await == lab.committed_of("dbo.customers").len()
        && silver_open
        && query(&silver, "SELECT order_id FROM t")
            .await
            .iter()
            .map(|batch| batch.num_rows())
            .sum::<usize>()
            == source_rows(lab).await.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_table_slot_every_table_of_a_continuous_sidecar_takes_its_turn() {
    let lab = Lab::new().await;
    lab.workload(47, 100);
    let path = write_config(
        &lab,
        &[("dbo.orders", "orders"), ("dbo.customers", "customers")],
    );
    let mut config = SidecarConfig::load(&path).expect("config");
    config.poll_seconds = 0.2;
    // One slot for two streams, a snapshot check each and an apply: a unit that held its
    // slot while waiting, or took a second one, would stop the others here.
    config.table_slots = 1;
    config.tables[0].silver = Some(lab.lake("silver_orders"));
    config.tables[0].keys = vec!["order_id".into()];
    config.tables[0].apply_seconds = Some(0.2);
    // The quiet table keeps a history beside its stream, applied by the same loop.
    config.tables[1].history = Some(lab.lake("history_customers"));
    config.tables[1].keys = vec!["customer_id".into()];
    config.tables[1].track_history_columns = vec!["is_active".into()];
    config.tables[1].apply_seconds = Some(0.2);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move { sidecar::run_continuous(&config, stopped).await });
    for more in [Some(48), None] {
        let mut caught_up = false;
        for _ in 0..600 {
            if both_tables_caught_up(&lab).await {
                caught_up = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(
            caught_up,
            "the tables did not all catch up (more commits: {more:?})"
        );
        if let Some(seed) = more {
            lab.workload(seed, 40);
        }
    }
    // The history of the quiet table, applied in the same turns, is what the journal says.
    let mut differences = String::new();
    for _ in 0..300 {
        differences = history_differences(&lab, "customers", "customer_id", &["is_active"]).await;
        if differences.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(differences.is_empty(), "{differences}");
    stop.send(true).expect("stop");
    tokio::time::timeout(std::time::Duration::from_secs(30), running)
        .await
        .expect("the sidecar stops")
        .expect("join");
}

/// Where the history `history_<name>` differs from the model of the journal (empty when it
/// does not).
async fn history_differences(lab: &Lab, name: &str, key: &str, tracked: &[&str]) -> String {
    use common::history;
    let location = lab.lake(&format!("history_{name}"));
    if tables::open(&tables::table_url(&location).expect("url"))
        .await
        .expect("open")
        .is_none()
    {
        return format!("no history at {location} yet");
    }
    let table = format!("dbo.{name}");
    let bronze = lab.lake(&format!("bronze_{name}"));
    let expected = history::expected(
        &history::journal(lab, &table),
        &history::held_commits(&bronze, key).await,
        &history::complete_snapshots(lab, &bronze).await,
        &|row, content| history::generated(&lab.db, &table, tracked, row, content),
    );
    assert!(expected.len() > 10, "{} versions expected", expected.len());
    match history::held(&location, key, tracked).await {
        Ok(held) => history::differences(&expected, &held)
            .map(|differences| format!("history of {table}: {differences}"))
            .unwrap_or_default(),
        Err(error) => error,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_reconciles_silver_after_its_run_and_on_an_admin_call() {
    use mssql_cdc_writer::admin::{self, ReconcileRequest};

    let lab = Lab::new().await;
    lab.workload(81, 200);
    let path = write_config(
        &lab,
        &[("dbo.orders", "orders"), ("dbo.customers", "customers")],
    );
    let mut config = SidecarConfig::load(&path).expect("config");
    // Two tables' runs, each with its apply and reconcile, take turns at one slot.
    config.table_slots = 1;
    config.reconcile_report = Some(lab.lake("reconcile"));
    config.tables[0].silver = Some(lab.lake("silver_orders"));
    config.tables[0].keys = vec!["order_id".into()];
    config.tables[0].reconcile_minutes = Some(60.0);
    for (table, result) in sidecar::run_available_now(&config).await {
        result.unwrap_or_else(|error| panic!("{table}: {error}"));
    }
    // The available-now run reconciled once after its apply: the report and the verified LSN.
    let statuses = sidecar::status(&config).await.expect("status");
    let (verified, _) = statuses[0]
        .verified
        .clone()
        .expect("verified after the run");
    assert!(
        statuses[1].verified.is_none(),
        "dbo.customers has no silver"
    );
    let report = query(&lab.lake("reconcile"), "SELECT DISTINCT run_id FROM t").await;
    assert_eq!(
        report.iter().map(|batch| batch.num_rows()).sum::<usize>(),
        1
    );

    // The admin service reconciles on request, with the call's sample.
    config.admin_listen = Some("127.0.0.1:0".into());
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let server = admin::AdminServer::bind(&config)
        .await
        .expect("bind")
        .expect("admin_listen is set");
    let url = format!("http://{}", server.local_addr().expect("address"));
    tokio::spawn(server.serve(stopped));
    let result = admin::call_reconcile(
        &url,
        &Default::default(),
        ReconcileRequest {
            table: "dbo.orders".into(),
            sample: Some(1.0),
            bucket_rows: Some(50),
            seed: Some(3),
            value_sums: None,
        },
    )
    .await
    .expect("reconcile over the admin service");
    assert!(result.verified && result.clean(), "{result:?}");
    assert_eq!(result.hashed, result.buckets, "the call's sample of 1");
    assert!(
        !result.value_sums && result.values_verified,
        "every bucket read row by row: no value sums, every value compared: {result:?}"
    );
    let rows_only = admin::call_reconcile(
        &url,
        &Default::default(),
        ReconcileRequest {
            table: "dbo.orders".into(),
            sample: Some(0.0),
            value_sums: Some(false),
            ..ReconcileRequest::default()
        },
    )
    .await
    .expect("reconcile over the admin service");
    assert!(
        rows_only.verified && !rows_only.value_sums && !rows_only.values_verified,
        "the call's value sums off at sample 0: rows verified, values not: {rows_only:?}"
    );
    assert_eq!(
        result.compared_lsn.to_string(),
        verified,
        "nothing changed since"
    );
    let refused = admin::call_reconcile(
        &url,
        &Default::default(),
        ReconcileRequest {
            table: "dbo.customers".into(),
            ..ReconcileRequest::default()
        },
    )
    .await
    .expect_err("no silver to reconcile");
    assert!(refused.to_string().contains("no silver table"), "{refused}");
}

/// The lease holders of `app_ids` in the fleet's store at `leases`.
async fn holders(
    leases: &str,
    app_ids: &[String],
) -> std::collections::BTreeMap<String, Option<String>> {
    let mut store = mssql_cdc_writer::fleet::leases::Leases::open(leases)
        .await
        .expect("leases");
    store.holders(app_ids).await.expect("read the leases")
}

/// Writer processes, killed when dropped: a failing test leaves none running.
struct Replicas(Vec<(String, std::process::Child)>);

impl Drop for Replicas {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Whether every table's bronze holds exactly its journal (nothing lost or doubled).
async fn every_bronze_is_its_journal(lab: &Lab, tables: &[(String, String)]) -> bool {
    for (table, app_id) in tables {
        let held = common::change_rows(
            &lab.lake(&format!("bronze_{app_id}")),
            "SELECT _start_lsn, _seqval, _operation, order_id FROM t",
        )
        .await;
        if held.as_deref() != Some(lab.committed_of(table).as_slice()) {
            return false;
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_three_replicas_shares_the_tables_and_takes_over_a_killed_ones() {
    use std::process::{Command, Stdio};
    const LEASE_SECONDS: f64 = 2.0;
    let specs: Vec<_> = (0..6)
        .map(|n| {
            let mut spec = mssql_cdc_flight::sim::sample::orders();
            spec.table = mssql_cdc_flight::catalog::TableName::new("dbo", format!("orders_{n}"));
            spec
        })
        .collect();
    let lab = Lab::with_tables(&specs).await;
    lab.workload(57, 120);
    let tables: Vec<(String, String)> = (0..6)
        .map(|n| (format!("dbo.orders_{n}"), format!("orders_{n}")))
        .collect();
    let app_ids: Vec<String> = tables.iter().map(|(_, app_id)| app_id.clone()).collect();
    let pairs: Vec<(&str, &str)> = tables
        .iter()
        .map(|(table, app_id)| (table.as_str(), app_id.as_str()))
        .collect();
    let path = write_config(&lab, &pairs);
    let leases = lab.dir.path().join("leases").display().to_string();
    let mut text = std::fs::read_to_string(&path).expect("config");
    text = text.replacen(
        "granularity",
        "poll_seconds = 0.2\nmaintenance_minutes = 0.02\ngranularity",
        1,
    );
    text.push_str(&format!(
        "\n[fleet]\nleases = \"{leases}\"\nlease_seconds = {LEASE_SECONDS:?}\n"
    ));
    std::fs::write(&path, text).expect("config");
    let start = |name: &str| {
        Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
            .args(["run", "--config"])
            .arg(&path)
            .env("HOSTNAME", name)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(lab.dir.path().join(format!("{name}.log"))).expect("log"))
            .spawn()
            .expect("replica")
    };
    let mut replicas = Replicas(
        ["r0", "r1", "r2"]
            .into_iter()
            .map(|name| (name.to_string(), start(name)))
            .collect(),
    );
    let logs = |lab: &Lab| {
        ["r0", "r1", "r2", "r3"]
            .iter()
            .map(|name| {
                let log = std::fs::read_to_string(lab.dir.path().join(format!("{name}.log")));
                format!("--- {name}:\n{}", log.unwrap_or_default())
            })
            .collect::<String>()
    };
    // Waits up to `seconds` for `done`, failing with the replicas' logs.
    macro_rules! wait_for {
        ($what:expr, $seconds:expr, $done:expr) => {{
            let began = std::time::Instant::now();
            loop {
                let done: bool = $done;
                if done {
                    break began.elapsed();
                }
                if began.elapsed() > std::time::Duration::from_secs($seconds) {
                    panic!("never: {} within {} s\n{}", $what, $seconds, logs(&lab));
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }};
    }
    let share = |holders: &std::collections::BTreeMap<String, Option<String>>| {
        let mut counts = std::collections::BTreeMap::<String, usize>::new();
        for holder in holders.values().flatten() {
            let name = holder
                .split_once('@')
                .map_or(holder.as_str(), |(name, _)| name);
            *counts.entry(name.to_string()).or_default() += 1;
        }
        counts
    };
    wait_for!("the three replicas hold two tables each", 60, {
        let counts = share(&holders(&leases, &app_ids).await);
        counts.len() == 3 && counts.values().all(|count| *count == 2)
    });
    wait_for!("every table's bronze holds its journal", 120, {
        every_bronze_is_its_journal(&lab, &tables).await
    });
    // `status` names each table's replica.
    let status = Command::new(env!("CARGO_BIN_EXE_mssql-cdc-writer"))
        .args(["status", "--config"])
        .arg(&path)
        .output()
        .expect("status");
    let printed = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{printed}");
    for name in ["r0@", "r1@", "r2@"] {
        assert_eq!(
            printed.matches(name).count(),
            2,
            "{name} holds two tables:\n{printed}"
        );
    }
    // More commits, and the replica holding dbo.orders_0 killed while they stream.
    lab.workload(58, 120);
    let before = holders(&leases, &app_ids).await;
    let victim = before["orders_0"].clone().expect("held");
    let victim_name = victim.split_once('@').expect("id").0.to_string();
    let orphans: Vec<&String> = before
        .iter()
        .filter(|(_, holder)| holder.as_deref() == Some(victim.as_str()))
        .map(|(app_id, _)| app_id)
        .collect();
    let (_, child) = replicas
        .0
        .iter_mut()
        .find(|(name, _)| *name == victim_name)
        .expect("victim");
    child.kill().expect("kill");
    let _ = child.wait();
    let taken = wait_for!("the killed replica's tables are taken over", 60, {
        let now = holders(&leases, &app_ids).await;
        orphans.iter().all(|app_id| {
            now[*app_id]
                .as_deref()
                .is_some_and(|holder| !holder.starts_with(&format!("{victim_name}@")))
        })
    });
    println!(
        "{} tables of a killed replica taken over {:.1} s after the kill (lease {LEASE_SECONDS} s)",
        orphans.len(),
        taken.as_secs_f64()
    );
    assert!(
        taken.as_secs_f64() < LEASE_SECONDS * 3.0 + 2.0,
        "taken over after {taken:?}"
    );
    wait_for!(
        "every table's bronze holds its journal after the kill",
        120,
        { every_bronze_is_its_journal(&lab, &tables).await }
    );
    // A new replica joins: tables move to it until the shares are even again.
    replicas.0.push(("r3".to_string(), start("r3")));
    lab.workload(59, 60);
    wait_for!("the joining replica gets its share", 60, {
        let counts = share(&holders(&leases, &app_ids).await);
        counts.get("r3").is_some_and(|count| *count == 2) && counts.len() == 3
    });
    wait_for!(
        "every table's bronze holds its journal after the join",
        120,
        { every_bronze_is_its_journal(&lab, &tables).await }
    );
    // Stopped by SIGTERM, the replicas give their leases back.
    for (name, child) in &mut replicas.0 {
        if *name == victim_name {
            continue;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
    for (name, child) in &mut replicas.0 {
        if *name != victim_name {
            let status = child.wait().expect("wait");
            assert!(
                status.success(),
                "{name} exited with {status}\n{}",
                logs(&lab)
            );
        }
    }
    let after = holders(&leases, &app_ids).await;
    assert!(
        after.values().all(Option::is_none),
        "leases given back at the stop: {after:?}"
    );
    assert!(every_bronze_is_its_journal(&lab, &tables).await);
    // The facts hold one row per batch id of each table: no batch committed twice.
    for (_, app_id) in &tables {
        let rows = query(
            &lab.lake("facts"),
            &format!(
                "SELECT COUNT(*) = COUNT(DISTINCT batch_id) FROM t WHERE app_id = '{app_id}' \
                 AND batch_id IS NOT NULL AND event IS NULL"
            ),
        )
        .await;
        let once = rows[0]
            .column(0)
            .as_any()
            .downcast_ref::<arrow::array::BooleanArray>()
            .expect("bool")
            .value(0);
        assert!(once, "{app_id}: a batch id in the facts twice");
    }
}
