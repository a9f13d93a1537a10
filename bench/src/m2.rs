//! M2 parallel: 16 workers on distinct keys.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use crate::harness::{libraries, note_rss, peak_rss_kb, run_child, scenario_run, ChildArgs, Params, Rss, Setup};
use crate::libs::Lib;

scenario_run!(child, report);

/// Child process: M2 for one library.
async fn child(a: &ChildArgs) -> Value {
    let (lib, endpoint, table, n, tag) = (a.lib.as_str(), a.endpoint.as_str(), a.table.as_str(), a.n, a.tag.as_str());
    let l = Arc::new(Lib::new(lib, endpoint, table).await);
    let next = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (l, next, tag) = (l.clone(), next.clone(), tag.to_string());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i as usize >= n {
                    break;
                }
                let h = l.try_acquire(&format!("m2-{tag}-{i}"), "w").await.expect("distinct key");
                l.release(h).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    json!({"cycles": n, "secs": t.elapsed().as_secs_f64(), "rss_kb": peak_rss_kb()})
}

async fn report(s: &Setup, p: &Params, rss: &mut Rss) {
    let libs = libraries();
    let Params { m2n, .. } = *p;
    for lib in &libs {
        run_child(s, lib, "m2", 300, 0, &format!("{lib}-m2warm")).await;
    }
    println!("\nM2 parallel: 16 workers on distinct keys, {m2n} cycles");
    println!("{:<16} {:>10} {:>13}", "library", "cycles/s", "requests/cyc");
    for lib in &libs {
        let (v, reqs) = run_child(s, lib, "m2", m2n, 0, &format!("{lib}-m2")).await;
        let cps = m2n as f64 / v["secs"].as_f64().unwrap();
        note_rss(rss, lib, &v);
        println!("{:<16} {:>10.0} {:>13.2}", lib, cps, reqs as f64 / m2n as f64);
    }
}
