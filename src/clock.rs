//! Wall-clock time as stowage records it: milliseconds since the Unix epoch.
//!
//! - `STOWAGE_NOW` (RFC 3339, or seconds since the epoch) fixes the clock for tests of time-based
//!   policy; it affects recorded times only, never waits.
//! - Every recorded time lies between the epoch and the end of year 9999 (what RFC 3339 can write).
//!   A `STOWAGE_NOW` outside it (milliseconds given for seconds) or unparsable is refused before
//!   any command runs ([`check_env`]); a stored one outside it reads as unknown, never a panic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

/// Milliseconds since the epoch.
pub type Millis = i64;

/// The last millisecond of year 9999: the latest time RFC 3339 can write.
pub const MAX_MS: Millis = 253_402_300_799_999;

/// A time nobody knows (a damaged record's creation): before every time, written as unknown.
pub const UNKNOWN: Millis = -1;

pub fn now_ms() -> Millis {
    match std::env::var(crate::env::NOW) {
        // Checked at start ([`check_env`]); one that slipped past (a library caller): real clock.
        Ok(v) if !v.is_empty() => parse_time(&v).unwrap_or_else(|_| real_now_ms()),
        _ => real_now_ms(),
    }
}

/// When a tree was last modified (made, for an adopted one), else now.
pub fn tree_time(tree: &std::path::Path) -> Millis {
    std::fs::metadata(tree)
        .ok()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or_else(now_ms, |d| d.as_millis() as Millis)
}

fn real_now_ms() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| (d.as_millis() as Millis).clamp(0, MAX_MS))
}

/// Refuses a `STOWAGE_NOW` that is not a time stowage can record (exit 64).
pub fn check_env() -> std::result::Result<(), crate::Error> {
    match std::env::var_os(crate::env::NOW) {
        Some(v) if !v.is_empty() => {
            let s = v.to_string_lossy();
            parse_time(&s)
                .map(|_| ())
                .map_err(|e| crate::Error::Usage(format!("{}={s:?}: {e:#}", crate::env::NOW)))
        }
        _ => Ok(()),
    }
}

/// Parses RFC 3339 (`2026-11-29T12:03:04Z`) or plain epoch seconds, from the epoch to year 9999.
pub fn parse_time(s: &str) -> Result<Millis> {
    if let Ok(secs) = s.parse::<f64>() {
        if !secs.is_finite() {
            bail!("not a time");
        }
        let ms = secs * 1000.0;
        if !(0.0..=MAX_MS as f64).contains(&ms) {
            bail!(
                "{s} seconds since the epoch is {}, not a time stowage can record \
                 (seconds are expected, not milliseconds)",
                if ms < 0.0 {
                    "before 1970"
                } else {
                    "after year 9999"
                }
            );
        }
        return Ok(ms as Millis);
    }
    let t = parse_rfc3339(s)
        .context("not a time (RFC 3339, e.g. 2026-11-29T12:03:04Z, or epoch seconds)")?;
    let ms = t
        .duration_since(UNIX_EPOCH)
        .map_err(|_| anyhow::anyhow!("before 1970, not a time stowage can record"))?
        .as_millis();
    if ms > MAX_MS as u128 {
        bail!("after year 9999, not a time stowage can record");
    }
    Ok(ms as Millis)
}

/// RFC 3339 with any offset (`-05:00`) and either case: humantime reads only `Z` and `+00:00`.
fn parse_rfc3339(s: &str) -> Result<SystemTime> {
    let s = s.to_ascii_uppercase();
    let split = s.len().checked_sub(6).filter(|&i| s.is_char_boundary(i));
    let offset = split.map(|i| s.split_at(i)).and_then(|(time, off)| {
        let b = off.as_bytes();
        let two = |i: usize| u64::from(b[i] - b'0') * 10 + u64::from(b[i + 1] - b'0');
        let digits = [1, 2, 4, 5].iter().all(|&i| b[i].is_ascii_digit());
        let form = matches!(b[0], b'+' | b'-') && b[3] == b':' && digits && !time.ends_with('Z');
        let (hh, mm) = form.then(|| (two(1), two(4)))?;
        let by = Duration::from_secs((hh * 60 + mm) * 60);
        (hh < 24 && mm < 60).then(|| (format!("{time}Z"), b[0] == b'-', by))
    });
    let Some((utc, behind, by)) = offset else {
        return Ok(humantime::parse_rfc3339_weak(&s)?);
    };
    let local = humantime::parse_rfc3339_weak(&utc)?;
    // The offset is local time less UTC: a time behind UTC is later in UTC.
    let t = if behind {
        local.checked_add(by)
    } else {
        local.checked_sub(by)
    };
    t.context("out of range")
}

/// RFC 3339 UTC with second precision; None before 1970 or after year 9999.
pub fn rfc3339(ms: Millis) -> Option<String> {
    if !(0..=MAX_MS).contains(&ms) {
        return None;
    }
    let t = UNIX_EPOCH + Duration::from_millis(ms as u64);
    Some(humantime::format_rfc3339_seconds(t).to_string())
}

/// Local wall-clock time for messages: `12:03:04` today, else with the date.
pub fn local_short(ms: Millis) -> String {
    let Some((date, time)) = local_parts(ms) else {
        return "an unknown time".into();
    };
    if Some(&date) == local_parts(now_ms()).as_ref().map(|(today, _)| today) {
        time
    } else {
        format!("{date} {time}")
    }
}

/// Local date and time for tables: `2026-11-29 12:03`.
pub fn local_minutes(ms: Millis) -> String {
    local_parts(ms).map_or_else(
        || "unknown".into(),
        |(date, time)| format!("{date} {}", &time[..5]),
    )
}

/// The local date and time of `ms`; None before 1970 or after year 9999.
fn local_parts(ms: Millis) -> Option<(String, String)> {
    let utc = rfc3339(ms)?;
    let secs = (ms / 1000) as libc::time_t;
    // SAFETY: localtime_r writes only into `tm`, which we own.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&secs, &mut tm) }.is_null() {
        return Some((utc[..10].to_owned(), utc[11..19].to_owned()));
    }
    let (y, m, d) = (tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday);
    let (h, min, s) = (tm.tm_hour, tm.tm_min, tm.tm_sec);
    Some((
        format!("{y:04}-{m:02}-{d:02}"),
        format!("{h:02}:{min:02}:{s:02}"),
    ))
}

/// "3 s", "12 min", "5 h", "2 days": how long ago, for humans.
pub fn ago(ms: Millis) -> String {
    let secs = (now_ms().saturating_sub(ms) / 1000).max(0);
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
    fn formats_rfc3339_utc_and_parses_both_forms() {
        let (ms, text) = (1_795_953_784_000, "2026-11-29T12:03:04Z");
        assert_eq!(rfc3339(ms).as_deref(), Some(text));
        assert_eq!(rfc3339(MAX_MS + 1), None);
        assert_eq!(rfc3339(i64::MAX), None);
        assert_eq!(rfc3339(-1), None);
        assert_eq!(local_minutes(i64::MAX), "unknown");
        assert_eq!(local_short(i64::MIN), "an unknown time");
        let _ = ago(i64::MIN);
        assert_eq!(parse_time(text).unwrap(), ms);
        assert_eq!(parse_time("1795953784").unwrap(), ms);
        for same in [
            "2026-11-29t12:03:04z",
            "2026-11-29T07:03:04-05:00",
            "2026-11-30T02:03:04+14:00",
        ] {
            assert_eq!(parse_time(same).unwrap(), ms, "{same}");
        }
        // 1795953784000: milliseconds where seconds are meant, year 58880.
        for bad in [
            "yesterday",
            "nan",
            "1795953784000",
            "-5",
            "2026-11-29T12:03:04+24:00",
            "2026-11-29T12:03:04+00:60",
            "2026-11-29T12:03:04Z+01:00",
            "2026-11-29T12:03:04++1:00",
            "2026-11-29T12:03:04+0é:00",
            "é-05:00",
            "9999-12-31T23:59:59-23:59",
        ] {
            assert!(parse_time(bad).is_err(), "{bad}");
        }
    }
}
