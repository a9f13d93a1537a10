//! M4 crash handover: A holds a 2 s lease and dies, B already waits; the gap between A's last
//! write and B's acquiring write, from the proxy's log. Runs in the parent process.

use std::time::Duration;

use leasehold::Config;

use crate::harness::{libraries, scenario_run, Params, Rss, Setup};
use crate::libs::Lib;

/// M4: A holds a 2 s lease and dies; B already waits. The gap between A's last write and B's
/// acquiring write, from the proxy's log.
async fn trial(s: &Setup, lib: &str, trial: usize) -> f64 {
    let key = format!("m4-{lib}-{trial}");
    s.proxy.record(true);
    let endpoint = s.proxy.endpoint();
    let table = s.tables[lib].clone();
    // A in its own runtime, torn down without releasing: a crash.
    let (k2, e2, t2, l2) = (key.clone(), endpoint.clone(), table.clone(), lib.to_string());
    let a_done = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async {
            let l = Lib::new_with_lease(&l2, &e2, &t2, Duration::from_secs(2)).await;
            let h = l.try_acquire(&k2, "A").await.expect("A acquires");
            std::mem::forget(h);
            std::mem::forget(l);
        });
        rt.shutdown_background();
    });
    a_done.join().unwrap();
    let b = Lib::new_with_lease(lib, &endpoint, &table, Duration::from_secs(2)).await;
    let h = b.acquire_wait(&key, "B", Duration::from_secs(10)).await.expect("B acquires");
    s.proxy.record(false);
    let events = s.proxy.events();
    let writes: Vec<_> = events
        .iter()
        .filter(|e| {
            e.status == 200 && matches!(e.target.as_str(), "PutItem" | "UpdateItem") && e.request.contains(&key)
        })
        .collect();
    let gap = match (writes.first(), writes.last()) {
        (Some(a), Some(b)) if writes.len() >= 2 => (b.at_ms - a.at_ms) as f64,
        _ => f64::NAN,
    };
    b.release(h).await;
    gap
}

scenario_run!(parent_only report);

async fn report(s: &Setup, p: &Params, _rss: &mut Rss) {
    let libs = libraries();
    let Params { m4trials, .. } = *p;
    let margin = Config::default().skew_margin.as_millis();
    println!("\nM4 crash handover: A holds a 2,000 ms lease and dies, B already waits; gap between A's last write and B's acquiring write (proxy clock); skew margin {margin} ms, bound 2,000..={} ms", 2000 + margin + 100);
    // The bare pairs have no expiry to wait out; leasehold+index runs in M1 and M2 only.
    let bare = |l: &str| l.starts_with("raw") || l.starts_with("shaped-") || l == "leasehold+index";
    for lib in libs.iter().filter(|l| !bare(l)) {
        let mut gaps = Vec::new();
        for t in 0..m4trials {
            gaps.push(trial(s, lib, t).await);
        }
        println!("{:<16} gaps ms: {}", lib, gaps.iter().map(|g| format!("{g:.0}")).collect::<Vec<_>>().join(", "));
    }
}
