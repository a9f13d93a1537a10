//! M3 contention: 8 workers (separate clients) on one key, hold 5 ms, each library's own
//! waiting; and the ceiling no library can exceed on this machine.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use leasehold_tests::{sdk_config_for, Holds};
use serde_json::{json, Value};

use crate::harness::{
    libraries, note_rss, pct, peak_rss_kb, run_child_counts, scenario_run, ChildArgs, Params, Rss, Setup,
};
use crate::libs::Lib;

/// M3's physical limit, measured here: the median time a 5 ms hold really takes (the timer's
/// granularity included) and the median round trip of a `GetItem` through the proxy.
async fn hold_and_round_trip(s: &Setup) -> (f64, f64) {
    let client = aws_sdk_dynamodb::Client::new(&sdk_config_for(&s.proxy.endpoint()).await);
    let table = &s.tables["leasehold"];
    let (mut holds, mut rtts) = (Vec::new(), Vec::new());
    for i in 0..200 {
        let t = Instant::now();
        tokio::time::sleep(Duration::from_millis(5)).await;
        holds.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        client
            .get_item()
            .table_name(table)
            .key("key", AttributeValue::S(format!("rtt-{i}")))
            .consistent_read(true)
            .send()
            .await
            .expect("get");
        rtts.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    for v in [&mut holds, &mut rtts] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    (pct(&holds, 0.5), pct(&rtts, 0.5))
}

scenario_run!(child, report);

/// Child process: M3 for one library.
async fn child(a: &ChildArgs) -> Value {
    let (lib, endpoint, table, secs, tag) =
        (a.lib.as_str(), a.endpoint.as_str(), a.table.as_str(), a.secs, a.tag.as_str());
    // 8 workers, each with its own client, on one key.
    let mut libs = Vec::new();
    for _ in 0..8 {
        libs.push(Arc::new(Lib::new(lib, endpoint, table).await));
    }
    let key = format!("m3-{tag}");
    let holds = Arc::new(Holds::default());
    let last_release = Arc::new(Mutex::new(None::<Instant>));
    let handovers = Arc::new(Mutex::new(Vec::<f64>::new()));
    let stop_at = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for (w, l) in libs.into_iter().enumerate() {
        let (key, holds, last_release, handovers) =
            (key.clone(), holds.clone(), last_release.clone(), handovers.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = 0u64;
            while Instant::now() < stop_at {
                let remaining = stop_at.saturating_duration_since(Instant::now());
                let Some(h) = l.acquire_wait(&key, &format!("w{w}"), remaining.max(Duration::from_millis(1))).await
                else {
                    continue;
                };
                if let Some(r) = *last_release.lock().unwrap() {
                    handovers.lock().unwrap().push(r.elapsed().as_secs_f64() * 1000.0);
                }
                holds.enter();
                tokio::time::sleep(Duration::from_millis(5)).await;
                holds.leave();
                *last_release.lock().unwrap() = Some(Instant::now());
                l.release(h).await;
                mine += 1;
            }
            mine
        }));
    }
    let mut per = Vec::new();
    for t in tasks {
        per.push(t.await.unwrap());
    }
    let mut h = handovers.lock().unwrap().clone();
    h.sort_by(|a, b| a.partial_cmp(b).unwrap());
    json!({"per_worker": per, "acquisitions": per.iter().sum::<u64>(), "overlaps": holds.overlaps(),
               "handover_p50": pct(&h, 0.5), "handover_p99": pct(&h, 0.99), "rss_kb": peak_rss_kb()})
}

async fn report(s: &Setup, p: &Params, rss: &mut Rss) {
    let libs = libraries();
    let Params { m3s, .. } = *p;
    println!(
        "\nM3 contention: 8 workers (separate clients) on ONE key for {m3s} s, hold 5 ms, each library's own waiting"
    );
    println!(
        "(req/acq: every request per acquisition, releases included; put/acq: acquiring PutItems per acquisition)"
    );
    println!(
        "{:<20} {:>8} {:>16} {:>9} {:>11} {:>11} {:>9} {:>9} {:>9}",
        "library", "acq", "per-worker", "max/min", "hand p50", "hand p99", "req/acq", "put/acq", "overlaps"
    );
    let mut acqs = BTreeMap::new();
    // dynamodb-lease twice: releasing with `Lease::release().await`, and by dropping the
    // lease (its documented default: the item is deleted in a spawned task).
    let mut m3libs: Vec<&str> = libs.iter().copied().filter(|l| !matches!(*l, "raw" | "leasehold+index")).collect();
    if cfg!(feature = "compare") {
        m3libs.push("dynamodb-lease/drop");
    }
    // `LEASEHOLD_BENCH_POLL_ATTEMPTS=1.2,3`: leasehold also with those targets of attempts per
    // acquisition (`Config::poll_attempts`), each after the default one.
    if let Ok(v) = std::env::var("LEASEHOLD_BENCH_POLL_ATTEMPTS") {
        let at = m3libs.iter().position(|l| *l == "leasehold").map_or(m3libs.len(), |i| i + 1);
        for (i, x) in v.split(',').map(str::trim).filter(|x| !x.is_empty()).enumerate() {
            m3libs.insert(at + i, Box::leak(format!("leasehold/poll={x}").into_boxed_str()));
        }
    }
    // Unmeasured first: DynamoDB Local compiles its refusal path (a condition that fails and
    // returns the item) only under contention, which the M1 warm-up never reaches; without this
    // the first library measured ran at about 0.8x of itself measured later.
    run_child_counts(s, "leasehold", "m3", 0, m3s.min(5), "warm-m3").await;
    for lib in &m3libs {
        let (v, counts) = run_child_counts(s, lib, "m3", 0, m3s, &format!("{}-m3", lib.replace('/', "-"))).await;
        // Client set-up (dynamodb-lease describes the table) is not part of the contention.
        let reqs: u64 = counts.iter().filter(|(op, _)| !op.starts_with("Describe")).map(|(_, n)| n).sum();
        let puts = counts.get("PutItem").copied().unwrap_or(0);
        if std::env::var_os("LEASEHOLD_BENCH_VERBOSE").is_some() {
            eprintln!("m3 {lib}: {v}");
        }
        let per: Vec<u64> = v["per_worker"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        let acq = v["acquisitions"].as_u64().unwrap();
        acqs.insert(*lib, acq);
        let (mx, mn) = (*per.iter().max().unwrap(), *per.iter().min().unwrap());
        note_rss(rss, lib, &v);
        println!(
            "{:<20} {:>8} {:>16} {:>9} {:>9.1}ms {:>9.1}ms {:>9.2} {:>9.2} {:>9}",
            lib,
            acq,
            format!("{mn}..{mx}"),
            if mn == 0 { "inf".to_string() } else { format!("{:.2}", mx as f64 / mn as f64) },
            v["handover_p50"].as_f64().unwrap_or(f64::NAN),
            v["handover_p99"].as_f64().unwrap_or(f64::NAN),
            reqs as f64 / acq.max(1) as f64,
            puts as f64 / acq.max(1) as f64,
            v["overlaps"]
        );
    }
    for other in ["dynamodb-lease", "dynamodb-lease/drop"] {
        if let Some(dl) = acqs.get(other) {
            println!("leasehold / {other} acquisitions: {:.2}x", acqs["leasehold"] as f64 / (*dl).max(1) as f64);
        }
    }
    // What no library can exceed: holds back to back, each next holder learning of the
    // release within one request round trip, without a single wasted request.
    let (hold, rtt) = hold_and_round_trip(s).await;
    let ceiling = m3s as f64 * 1000.0 / (hold + rtt);
    println!(
            "ceiling for any library without overlapping holds: {m3s} s / (hold {hold:.2} ms + one round trip {rtt:.2} ms) = {ceiling:.0} acquisitions"
        );
}
