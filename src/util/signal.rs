//! SIGINT and SIGTERM: the first one sets a flag that long loops poll at
//! safe points ([`check`]: between windows, streams and tensors), so the run
//! stops there, its temporaries and claimed folders are removed by their
//! drops, and `main` exits 128 + the signal number (130, 143) after saying
//! what was completed. A second signal of the same kind ends the process at
//! once (the default action), for a run stuck outside a safe point.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::Result;

static RECEIVED: OnceLock<Arc<AtomicUsize>> = OnceLock::new();

/// The error a stopped run returns; `main` maps it to exit 128 + `signal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted {
    pub signal: i32,
}

impl Interrupted {
    pub fn exit_code(self) -> u8 {
        (128 + self.signal).clamp(0, 255) as u8
    }
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.signal {
            signal_hook::consts::SIGINT => "SIGINT",
            signal_hook::consts::SIGTERM => "SIGTERM",
            _ => "a signal",
        };
        write!(f, "interrupted by {name}; temporary files removed")
    }
}

impl std::error::Error for Interrupted {}

/// Installs the handlers (once; later calls do nothing).
pub fn install() -> Result<()> {
    if RECEIVED.get().is_some() {
        return Ok(());
    }
    let flag = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let seen = Arc::new(AtomicBool::new(false));
        // Order matters: the conditional default fires only once `seen` is set by the second hook.
        signal_hook::flag::register_conditional_default(sig, Arc::clone(&seen))?;
        signal_hook::flag::register(sig, seen)?;
        signal_hook::flag::register_usize(sig, Arc::clone(&flag), sig as usize)?;
    }
    let _ = RECEIVED.set(flag);
    Ok(())
}

/// The signal received so far, if any.
pub fn received() -> Option<Interrupted> {
    let s = RECEIVED.get()?.load(Ordering::SeqCst);
    (s != 0).then_some(Interrupted { signal: s as i32 })
}

/// `Err(Interrupted)` once a signal has arrived: call at safe points.
pub fn check() -> Result<()> {
    match received() {
        Some(i) => Err(i.into()),
        None => Ok(()),
    }
}

/// The exit code for an error: 128 + signal for an interrupted run, else `default`.
pub fn exit_code_for(e: &anyhow::Error, default: u8) -> u8 {
    e.downcast_ref::<Interrupted>().map_or(default, |i| i.exit_code())
}
