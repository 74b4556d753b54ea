//! How busy the machine's cores were over a run, from `/proc/stat`. Every daemon, reader,
//! containerd and the relays share one machine: where its cores were near all busy, a time
//! ÷ time at N = 1 above 1 tells of the machine, not of the origin or the bridge.

/// The cores' busy and total time so far, in clock ticks.
#[derive(Clone, Copy)]
pub struct Cores {
    busy: u64,
    total: u64,
}

impl Cores {
    pub fn now() -> Cores {
        let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat is readable");
        let line = stat.lines().next().expect("/proc/stat has the cpu line");
        // user nice system idle iowait irq softirq steal (guest is counted in user already).
        let f: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|v| v.parse().unwrap_or(0)).collect();
        let total: u64 = f.iter().sum();
        let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
        Cores { busy: total - idle, total }
    }

    /// The share of all cores' time that was busy since `self`, 0 to 1.
    pub fn busy_since(&self) -> f64 {
        let now = Cores::now();
        let total = now.total.saturating_sub(self.total);
        if total == 0 { 0.0 } else { now.busy.saturating_sub(self.busy) as f64 / total as f64 }
    }
}
