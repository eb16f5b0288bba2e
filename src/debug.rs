//! A hidden hook for tests that must stop a process at an exact point (to SIGKILL it there):
//! `STOWAGE_DEBUG_PAUSE=POINT:FILE[,POINT:FILE…]` makes the process create FILE when it reaches
//! POINT, then wait there (up to a minute) for the test to act: kill it, or remove FILE to let it
//! go on. Unset, it costs one environment lookup.

use std::time::{Duration, Instant};

pub fn pause(point: &str) {
    let Some(spec) = std::env::var_os(crate::env::DEBUG_PAUSE) else {
        return;
    };
    let spec = spec.to_string_lossy();
    for item in spec.split(',') {
        if let Some((p, file)) = item.split_once(':')
            && p == point
        {
            let _ = std::fs::write(file, std::process::id().to_string());
            let until = Instant::now() + Duration::from_secs(60);
            // A termination signal ends the pause: the test can watch what the process does next.
            while Instant::now() < until
                && std::path::Path::new(file).exists()
                && crate::lock::interrupted().is_none()
                && !crate::signals::termination_pending()
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
