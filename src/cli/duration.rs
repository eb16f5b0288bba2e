//! The one grammar of a time on the command line (`--wait`, `--watch`, `--hold-probe`,
//! `gc --unused-for`): a number, fractional or not, and a unit; a bare number is seconds, except
//! for `--unused-for`, where a forgotten unit would remove what a week's `7d` keeps. README.md
//! ("Times") documents it; the wrappers' `time_ms` (scripts/ch-wrapper.bash) reads it too.

use std::time::Duration;

use anyhow::Result;

use crate::error::Error;

/// The units a time takes, as help texts and messages list them: one list everywhere.
macro_rules! time_units {
    () => {
        "ms, s, m, h, d, w"
    };
}

/// A time option, and what its value may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TimeOption {
    /// How long to wait for locks (exec, rm): 0 tries once.
    Wait,
    /// lock-status's refresh interval.
    Watch,
    /// How long doctor holds its probe lock.
    HoldProbe,
    /// gc's age of an unused image: whole seconds (as its report says it), a unit required.
    UnusedFor,
}

/// The longest time accepted: ten years. More is surely a mistake (forever is no `--wait`).
const MAX_SECS: f64 = 10.0 * 365.0 * 86_400.0;

impl TimeOption {
    fn flag(self) -> &'static str {
        match self {
            TimeOption::Wait => "--wait",
            TimeOption::Watch => "--watch",
            TimeOption::HoldProbe => "--hold-probe",
            TimeOption::UnusedFor => "--unused-for",
        }
    }

    /// `raw` read by the grammar; anything else is a usage error (exit 64) naming the option.
    pub(super) fn parse(self, raw: &str) -> Result<Duration> {
        let flag = self.flag();
        let t = raw.trim();
        let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
        let (number, unit) = (t[..split].trim(), t[split..].trim());
        let examples = match self {
            TimeOption::UnusedFor => "e.g. 30m, 12h, 7d, 2w",
            _ => "e.g. 10 or 2.5 seconds, 500ms, 1.5m, 2h, 1d",
        };
        let bad = || {
            let units = time_units!();
            Error::Usage(format!(
                "{flag} '{raw}': not a time (a number and a unit of {units}; {examples})"
            ))
        };
        let scale = match unit {
            "ms" | "msec" => 1e-3,
            "" | "s" | "sec" | "secs" | "second" | "seconds" => 1.0,
            "m" | "min" | "mins" | "minute" | "minutes" => 60.0,
            "h" | "hr" | "hrs" | "hour" | "hours" => 3600.0,
            "d" | "day" | "days" => 86_400.0,
            "w" | "week" | "weeks" => 604_800.0,
            // Lengths that vary, and M, which is a month to some and a minute to others.
            "M" => {
                return super::usage(format!(
                    "{flag} '{raw}': M reads as a minute or a month: give m for minutes, days for months (30d)"
                ));
            }
            "month" | "months" | "y" | "year" | "years" => {
                return super::usage(format!(
                    "{flag} '{raw}': months and years have no one length: give days (30d, 365d)"
                ));
            }
            _ => return Err(bad().into()),
        };
        // f64's parser takes "inf", "NaN" and "1e3"; a time is digits and a point.
        let digit = |c: char| c.is_ascii_digit() || ".-+".contains(c);
        if !number.chars().any(|c| c.is_ascii_digit()) || !number.chars().all(digit) {
            return Err(bad().into());
        }
        let secs = number.parse::<f64>().map_err(|_| bad())? * scale;
        self.check(raw, unit, secs)?;
        // Within a millionth of a second of whole ones (the checks said): the report's seconds.
        let whole = self == TimeOption::UnusedFor;
        let secs = if whole { secs.round() } else { secs };
        // -0 is 0.
        Ok(Duration::from_secs_f64(secs.max(0.0)))
    }

    /// The bounds on `secs`, read from `raw` with `unit`.
    fn check(self, raw: &str, unit: &str, secs: f64) -> Result<()> {
        let flag = self.flag();
        let zero_ok = self != TimeOption::Watch && self != TimeOption::HoldProbe;
        if secs < 0.0 || (secs == 0.0 && !zero_ok) {
            let least = if zero_ok { "0 or more" } else { "above 0" };
            return super::usage(format!("{flag} '{raw}': must be {least}"));
        }
        if !secs.is_finite() || secs > MAX_SECS {
            let forever = match self {
                TimeOption::Wait => format!("; omit {flag} to wait forever"),
                _ => String::new(),
            };
            return super::usage(format!(
                "{flag} '{raw}': too long (at most 3650d, ten years{forever})"
            ));
        }
        if self == TimeOption::UnusedFor {
            let n = raw.trim();
            // Zero is zero in any unit; any other number means nothing without one.
            if unit.is_empty() && secs > 0.0 {
                return super::usage(format!(
                    "{flag} '{n}': give a unit (e.g. {n}d for days, {n}h, {n}m, or {n}s for seconds)"
                ));
            }
            // Its report counts whole seconds: a fraction would be dropped unsaid.
            if (secs - secs.round()).abs() > 1e-6 {
                return super::usage(format!(
                    "{flag} '{n}': not a whole number of seconds (gc counts ages in seconds)"
                ));
            }
        }
        Ok(())
    }
}

/// The deadline for `--wait S` / `--no-wait` / neither (forever), and whether it is "try once".
pub(super) fn deadline(
    wait: Option<&str>,
    no_wait: bool,
) -> Result<(Option<std::time::Instant>, bool)> {
    let now = std::time::Instant::now;
    match (wait, no_wait) {
        (_, true) => Ok((Some(now()), true)),
        (Some(raw), false) => {
            let d = TimeOption::Wait.parse(raw)?;
            Ok((Some(now() + d), d.is_zero()))
        }
        (None, false) => Ok((None, false)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(opt: TimeOption, raw: &str) -> Option<f64> {
        opt.parse(raw).map(|d| d.as_secs_f64()).ok()
    }

    #[test]
    fn times_in_seconds_or_with_units() {
        let s = |raw: &str| secs(TimeOption::Wait, raw);
        assert_eq!(s("10"), Some(10.0));
        assert_eq!(s("2.5"), Some(2.5));
        assert_eq!(s("0"), Some(0.0));
        assert_eq!(s("-0"), Some(0.0));
        assert_eq!(s("10s"), Some(10.0));
        assert_eq!(s("10seconds"), Some(10.0));
        assert_eq!(s("500ms"), Some(0.5));
        assert_eq!(s("1.5m"), Some(90.0));
        assert_eq!(s("2mins"), Some(120.0));
        assert_eq!(s("2h"), Some(7200.0));
        assert_eq!(s("1hour"), Some(3600.0));
        assert_eq!(s("1d"), Some(86_400.0));
        assert_eq!(s("1w"), Some(604_800.0));
        assert_eq!(s("2weeks"), Some(1_209_600.0));
        assert_eq!(s(" 3 s "), Some(3.0));
        for bad in [
            "", "s", "-1", "-1s", "10x", "inf", "NaN", "1e3", "ten", "1.2.3", "1h30m", "1M",
            "6months", "1y", "1us", ".", "5 5",
        ] {
            assert_eq!(s(bad), None, "{bad:?} must be refused");
        }
        assert_eq!(s("100000d"), None, "beyond ten years");
    }

    /// Every option reads one grammar; they differ only in their bounds.
    #[test]
    fn every_time_option_reads_the_same_grammar() {
        for opt in [TimeOption::Wait, TimeOption::Watch, TimeOption::HoldProbe] {
            assert_eq!(secs(opt, "3hours"), Some(10_800.0), "{opt:?}");
            assert_eq!(secs(opt, "7"), Some(7.0), "{opt:?}");
        }
        assert_eq!(secs(TimeOption::Watch, "0"), None);
        assert_eq!(secs(TimeOption::HoldProbe, "0s"), None);
        let u = |raw: &str| secs(TimeOption::UnusedFor, raw);
        assert_eq!(u("3hours"), Some(10_800.0));
        assert_eq!(u("2weeks"), Some(1_209_600.0));
        assert_eq!(u("30minutes"), Some(1800.0));
        assert_eq!(u("1.5m"), Some(90.0));
        assert_eq!(u("0"), Some(0.0));
        assert_eq!(u("0d"), Some(0.0));
        for bad in ["7", "500ms", "1.5s", "1year", "6months", "1M", "-1d"] {
            assert_eq!(u(bad), None, "{bad:?} must be refused");
        }
    }
}
