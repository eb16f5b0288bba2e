//! Wall-clock time as stowage records it: milliseconds since the Unix epoch.
//!
//! `STOWAGE_NOW` (RFC 3339, or seconds since the epoch) fixes the clock, so
//! tests of time-based policy (gc's "unused for", LRU order) fake the passage
//! of time instead of sleeping. It affects recorded times only, never how
//! long anything waits.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

pub const NOW_ENV: &str = "STOWAGE_NOW";

/// Milliseconds since the epoch.
pub type Millis = i64;

pub fn now_ms() -> Millis {
    match std::env::var(NOW_ENV) {
        Ok(v) if !v.is_empty() => parse_time(&v).unwrap_or_else(|_| real_now_ms()),
        _ => real_now_ms(),
    }
}

fn real_now_ms() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as Millis)
}

/// Parses RFC 3339 (`2026-11-29T12:03:04Z`) or plain epoch seconds.
pub fn parse_time(s: &str) -> Result<Millis> {
    if let Ok(secs) = s.parse::<f64>() {
        if !secs.is_finite() {
            bail!("{s:?} is not a time");
        }
        return Ok((secs * 1000.0) as Millis);
    }
    let t = humantime::parse_rfc3339_weak(s)
        .with_context(|| format!("{s:?} is not an RFC 3339 time"))?;
    Ok(t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as Millis))
}

/// RFC 3339 UTC with second precision, as in the JSON contract.
pub fn rfc3339(ms: Millis) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Local wall-clock time for messages: `12:03:04` today, else with the date.
pub fn local_short(ms: Millis) -> String {
    let (date, time) = local_parts(ms);
    let (today, _) = local_parts(now_ms());
    if date == today {
        time
    } else {
        format!("{date} {time}")
    }
}

/// Local date and time for tables: `2026-11-29 12:03`.
pub fn local_minutes(ms: Millis) -> String {
    let (date, time) = local_parts(ms);
    format!("{date} {}", &time[..5])
}

fn local_parts(ms: Millis) -> (String, String) {
    let secs = (ms / 1000) as libc::time_t;
    // SAFETY: localtime_r writes only into `tm`, which we own.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let ok = unsafe { !libc::localtime_r(&secs, &mut tm).is_null() };
    if !ok {
        let s = rfc3339(ms);
        return (s[..10].to_owned(), s[11..19].to_owned());
    }
    (
        format!(
            "{:04}-{:02}-{:02}",
            tm.tm_year + 1900,
            tm.tm_mon + 1,
            tm.tm_mday
        ),
        format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec),
    )
}

/// "3 s", "12 min", "5 h", "2 days": how long ago, for humans.
pub fn ago(ms: Millis) -> String {
    let secs = ((now_ms() - ms) / 1000).max(0);
    match secs {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{} h", s / 3600),
        s => format!("{} days", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339_utc() {
        assert_eq!(rfc3339(1_795_953_784_000), "2026-11-29T12:03:04Z");
    }

    #[test]
    fn parses_both_forms() {
        assert_eq!(
            parse_time("2026-11-29T12:03:04Z").unwrap(),
            1_795_953_784_000
        );
        assert_eq!(parse_time("1795953784").unwrap(), 1_795_953_784_000);
        assert!(parse_time("yesterday").is_err());
        assert!(parse_time("nan").is_err());
    }
}
