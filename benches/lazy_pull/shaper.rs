//! The link's rate, shaped in the kernel: an HTB root on `lo` whose default class is unshaped,
//! and one class, at the link's rate, for what the delay proxy sends (`u32 match ip sport`).
//! Removed again on drop, so other loopback traffic is left as it was.

use std::process::Command;

#[derive(Debug)]
pub struct Shaper;

fn tc(args: &str) -> Result<(), String> {
    let out = Command::new("tc").args(args.split_whitespace()).output().map_err(|e| format!("tc: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("tc {args}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Shaper {
    /// Shapes traffic from loopback port `sport` to `rate` (tc syntax: `200mbit`, `1gbit`).
    pub fn on_lo(sport: u16, rate: &str) -> Result<Shaper, String> {
        // A root left over from an interrupted run would make the add fail.
        let _ = tc("qdisc del dev lo root");
        let shaper = Shaper;
        tc("qdisc add dev lo root handle 1: htb default 1")?;
        tc("class add dev lo parent 1: classid 1:1 htb rate 100gbit quantum 200000")?;
        // lo's MTU is 64 KiB, so the bucket holds at least one whole packet.
        tc(&format!(
            "class add dev lo parent 1: classid 1:2 htb rate {rate} ceil {rate} burst 64k cburst 64k quantum 65536"
        ))?;
        tc(&format!("filter add dev lo parent 1: protocol ip prio 1 u32 match ip sport {sport} 0xffff flowid 1:2"))?;
        Ok(shaper)
    }
}

impl Drop for Shaper {
    fn drop(&mut self) {
        if let Err(e) = tc("qdisc del dev lo root") {
            eprintln!("lazy_pull: could not remove the shaping on lo: {e}");
        }
    }
}
