//! Where the GPU time of a run goes, per op family of the backend seam, with
//! `INFERNIX_CUDA_PROFILE=1`: CUDA events (timing enabled) recorded on the
//! backend's one stream before and after each op, summed per family. Nothing
//! waits on the host per op (a [`Scope`] guard records the end event when the
//! op returns); the events are folded into the totals every
//! [`FOLD_EVERY`] ops (one wait on the last event then) and when the backend
//! is dropped, which logs one `PROFILE` line per family (milliseconds, calls,
//! share of the profiled time) and the device-memory peak seen at the
//! LM-head calls. Off by default: the events cost about a microsecond of host
//! time each. This module only measures; it changes no number.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use anyhow::{anyhow, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

use super::device::CudaDevice;

/// The environment variable that turns the profile on (`1`).
pub const PROFILE_ENV: &str = "INFERNIX_CUDA_PROFILE";

/// Ops timed before their events are folded into the totals.
const FOLD_EVERY: usize = 2048;

#[derive(Default)]
struct State {
    /// Recorded, not yet folded: (family, start, end).
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    /// family -> (milliseconds, calls).
    totals: BTreeMap<&'static str, (f64, usize)>,
    /// Smallest free device memory seen (bytes), and the total.
    min_free: Option<(usize, usize)>,
    /// Ops whose time was lost (an event that could not be recorded or timed).
    n_lost: usize,
}

/// The guard of one timed op: records its end event when dropped.
pub struct Scope<'a> {
    open: Option<(&'a OpProfile, &'a CudaDevice, &'static str, CudaEvent)>,
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        if let Some((prof, dev, family, start)) = self.open.take() {
            prof.close(dev, family, start);
        }
    }
}

/// Per-family GPU time of the ops a backend ran (empty unless enabled).
pub struct OpProfile {
    enabled: bool,
    /// Ops running now: an op made of other ops is timed once, as the outer family.
    depth: Cell<usize>,
    state: RefCell<State>,
}

impl OpProfile {
    /// On when `INFERNIX_CUDA_PROFILE=1`.
    pub fn from_env() -> Self {
        Self { enabled: std::env::var(PROFILE_ENV).is_ok_and(|v| v == "1"), depth: Cell::new(0), state: RefCell::default() }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Times the GPU work queued until the returned guard drops as `family`
    /// (nothing when disabled, or inside another timed op).
    pub fn scope<'a>(&'a self, dev: &'a CudaDevice, family: &'static str) -> Result<Scope<'a>> {
        if !self.enabled || self.depth.get() > 0 {
            return Ok(Scope { open: None });
        }
        let start = record(dev)?;
        self.depth.set(1);
        Ok(Scope { open: Some((self, dev, family, start)) })
    }

    /// Folds the events of one finished op (the guard's drop).
    fn close(&self, dev: &CudaDevice, family: &'static str, start: CudaEvent) {
        self.depth.set(0);
        let mut st = self.state.borrow_mut();
        // An event that cannot be recorded or timed loses this op's time only; counted and reported.
        match record(dev) {
            Ok(end) => st.pending.push((family, start, end)),
            Err(_) => st.n_lost += 1,
        }
        if st.pending.len() >= FOLD_EVERY && fold(&mut st).is_err() {
            st.n_lost += 1;
        }
    }

    /// Notes the device's free memory now (the peak use is total minus the least free seen).
    pub fn note_memory(&self, dev: &CudaDevice) -> Result<()> {
        if self.enabled {
            let (free, total) = dev.mem_info()?;
            let mut st = self.state.borrow_mut();
            st.min_free = Some(st.min_free.map_or((free, total), |(f, t)| (f.min(free), t)));
        }
        Ok(())
    }

    /// The `PROFILE` lines: every family's milliseconds, calls and share, then the memory peak.
    pub fn report(&self) -> Result<Vec<String>> {
        let mut st = self.state.borrow_mut();
        fold(&mut st)?;
        let sum: f64 = st.totals.values().map(|(ms, _)| ms).sum();
        let mut lines: Vec<String> = st
            .totals
            .iter()
            .map(|(family, (ms, n))| {
                format!("PROFILE {family:<12} {ms:>12.3} ms {n:>8} calls {:>6.2} %", if sum > 0.0 { 100.0 * ms / sum } else { 0.0 })
            })
            .collect();
        lines.push(format!("PROFILE {:<12} {sum:>12.3} ms (sum of the families)", "total"));
        if st.n_lost > 0 {
            lines.push(format!("PROFILE {} ops not timed (a CUDA event failed)", st.n_lost));
        }
        if let Some((free, total)) = st.min_free {
            lines.push(format!(
                "PROFILE device memory peak {:.3} GiB used of {:.3} GiB (least free at an LM-head call)",
                (total - free) as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64
            ));
        }
        Ok(lines)
    }
}

fn record(dev: &CudaDevice) -> Result<CudaEvent> {
    dev.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| anyhow!("profile: record a CUDA event: {e}"))
}

/// Waits for the pending events and adds their times to the totals.
fn fold(st: &mut State) -> Result<()> {
    for (family, start, end) in st.pending.drain(..) {
        let ms = start.elapsed_ms(&end).map_err(|e| anyhow!("profile: elapsed time of {family}: {e}"))?;
        let t = st.totals.entry(family).or_insert((0.0, 0));
        t.0 += f64::from(ms);
        t.1 += 1;
    }
    Ok(())
}
