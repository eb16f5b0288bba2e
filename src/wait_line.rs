//! A wait you can follow: the line saying what a process waits for, kept up to date while it
//! waits (docs/design.md, "A wait you can follow").
//!
//! - On a terminal, rewritten in place every second, never wrapping, and cleared however the wait
//!   ends: nothing half-written is left before the command's output or an error.
//! - Elsewhere, the first line, then a plain one at most every [`LOG_EVERY`].
//! - Holders and waiters are re-read (one look) at most every [`REREAD_EVERY`]: a bounded cost on
//!   a shared filesystem.
//! - [`announce`] is the one place that prints "waiting for …".
//! - A helper thread does it, so no wait loop needs to know; without one (a pids limit) the first
//!   line is all there is, and with `-q` nothing.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::clock;
use crate::ctx::Ctx;
use crate::holders::{LockReport, Look, Party, command_cut, pid_on};

/// How often the line is redrawn on a terminal.
const TTY_EVERY: Duration = Duration::from_secs(1);
/// How often a plain line is added where stderr is no terminal (unless a test sets its own).
const LOG_EVERY: Duration = Duration::from_secs(60);
/// How often, at most, holders and waiters are read again.
const REREAD_EVERY: Duration = Duration::from_secs(5);

/// What re-reads the awaited lock's report, for the line's details.
pub type Reread = Box<dyn FnMut(&Look) -> LockReport + Send>;

/// Set when the wait ends; the helper sleeps on its condition in between.
type Stop = (Mutex<bool>, Condvar);

/// The line of one wait; dropping it ends the updates and clears the line.
#[must_use = "the line is cleared when this is dropped: keep it for the wait"]
pub struct WaitLine {
    helper: Option<(Arc<Stop>, thread::JoinHandle<()>)>,
}

impl Drop for WaitLine {
    fn drop(&mut self) {
        if let Some((stop, handle)) = self.helper.take() {
            *crate::error::locked(&stop.0) = true;
            stop.1.notify_all();
            let _ = handle.join();
        }
    }
}

/// What one refresh of the line says.
struct Line {
    what: String,
    started: Instant,
    tty: bool,
    /// The place of this process among the lock's waiters, and how many.
    place: Option<(usize, usize)>,
    holders: Vec<Party>,
    /// This host, left out of the holder's description.
    host: String,
}

/// Says, before blocking, what a process waits for and who holds it ("stowage: waiting for write
/// lock on image 'app': held (read) by …"), kept up to date until the returned line is dropped.
pub fn announce(ctx: &Ctx, what: &str, holders: &str, reread: Option<Reread>) -> WaitLine {
    if ctx.quiet {
        return WaitLine { helper: None };
    }
    let first = format!("stowage: waiting for {what}: {holders}");
    let tty = std::io::stderr().is_terminal();
    if !tty {
        show(false, &first);
    }
    let stop = Arc::new((Mutex::new(false), Condvar::new()));
    let line = Line {
        what: what.to_owned(),
        started: Instant::now(),
        tty,
        place: None,
        holders: Vec::new(),
        host: ctx.me.host.clone(),
    };
    let ctx = ctx.clone();
    let flag = Arc::clone(&stop);
    let spawned = thread::Builder::new()
        .name("stowage-wait-line".into())
        .stack_size(256 * 1024)
        .spawn(move || follow(&ctx, line, reread, &flag));
    // Without a helper, the first line stays as a plain one.
    if tty {
        show(spawned.is_ok(), &first);
    }
    WaitLine {
        helper: spawned.ok().map(|handle| (stop, handle)),
    }
}

/// The helper's loop: redraw (or log) on each tick, re-read at most every [`REREAD_EVERY`], until
/// told to stop; then clear a terminal's line.
fn follow(ctx: &Ctx, mut line: Line, mut reread: Option<Reread>, stop: &Stop) {
    let every = match line.tty {
        true => TTY_EVERY,
        false => crate::env::debug_ms(crate::env::DEBUG_WAIT_LINE_MS, LOG_EVERY.as_millis() as u64),
    };
    let reread_every = REREAD_EVERY.min(every);
    let mut next_read = Instant::now();
    let mut stopped = crate::error::locked(&stop.0);
    loop {
        let (s, _) = stop
            .1
            .wait_timeout_while(stopped, every, |s| !*s)
            .unwrap_or_else(|e| e.into_inner());
        stopped = s;
        if *stopped {
            break;
        }
        if let Some(r) = reread.as_mut()
            && Instant::now() >= next_read
        {
            let report = r(&Look::new(ctx));
            line.place = place(&report.waiters);
            line.holders = report.holders;
            next_read = Instant::now() + reread_every;
        }
        show(line.tty, &line.render_in(line.tty.then(line_width)));
    }
    if line.tty {
        say("\r\x1b[K");
    }
}

impl Line {
    /// The line; within `width` characters (a terminal's), what matters least is left out first:
    /// the place in the queue, then the holder's command, so the holder is still named.
    fn render_in(&self, width: Option<usize>) -> String {
        let waited = span(self.started.elapsed().as_secs());
        let head = if self.tty {
            format!("stowage: waiting {waited} for {}", self.what)
        } else {
            format!("stowage: still waiting for {} after {waited}", self.what)
        };
        let queue = self.place.map_or(String::new(), |(at, of)| {
            format!(" ({} of {of} in queue)", ordinal(at))
        });
        let held = |command: usize| {
            self.holders.first().map_or(String::new(), |h| {
                let more = match self.holders.len() {
                    1 => String::new(),
                    n => format!(" and {} more", n - 1),
                };
                format!(": {}{more}", holder(h, &self.host, command))
            })
        };
        let full = format!("{head}{queue}{}", held(61));
        let Some(width) = width else { return full };
        [
            full,
            format!("{head}{}", held(61)),
            format!("{head}{}", held(16)),
        ]
        .into_iter()
        .find(|l| l.chars().count() <= width)
        .unwrap_or_else(|| format!("{head}{}", held(0)))
    }
}

/// "held by pid 4121 on node07 (make all) for 3m12s", the host only if another (the line is short);
/// the command cut to `command` characters, left out at 0.
fn holder(p: &Party, me: &str, command: usize) -> String {
    let who = pid_on(p, "a process stowage cannot identify", Some(me), false);
    let mut s = format!("held by {who}{}", command_cut(p, command));
    if let Some(t) = p.since {
        let secs = (clock::now_ms().saturating_sub(t) / 1000).max(0) as u64;
        s.push_str(&format!(" for {}", span(secs)));
    }
    s
}

/// This process's place among `waiters` (by when each began), and how many.
fn place(waiters: &[Party]) -> Option<(usize, usize)> {
    let mine = waiters
        .iter()
        .find(|p| p.lease.as_deref().is_some_and(crate::lease::is_mine))?;
    let ahead = waiters
        .iter()
        .filter(|p| p.since.unwrap_or(i64::MAX) < mine.since.unwrap_or(i64::MAX))
        .count();
    Some((ahead + 1, waiters.len()))
}

fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// "42s", "3m12s", "2h05m", "3d04h"
fn span(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s if s < 86_400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        s => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// The widest line stderr's terminal shows without wrapping (of 80 columns if it says none).
fn line_width() -> usize {
    // SAFETY: TIOCGWINSZ fills a winsize struct we own.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
    let columns = if ok && ws.ws_col > 0 { ws.ws_col } else { 80 };
    usize::from(columns).saturating_sub(1).max(20)
}

/// Shows `text`: rewritten in place with `redraw` (on a terminal), else as a line of its own.
fn show(redraw: bool, text: &str) {
    if redraw {
        // Cut to the terminal's width: a wrapped line cannot be rewritten.
        let fit = crate::ident::shortened(text, line_width());
        say(&format!("\r{fit}\x1b[K"));
    } else {
        say(&format!("{text}\n"));
    }
}

/// Writes to stderr, never panicking (stderr may be gone).
fn say(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes());
    let _ = err.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_and_places_read_well() {
        assert_eq!(span(5), "5s");
        assert_eq!(span(192), "3m12s");
        assert_eq!(span(7500), "2h05m");
        assert_eq!(span(3 * 86_400 + 4 * 3600), "3d04h");
        assert_eq!(ordinal(1), "1st");
        assert_eq!(ordinal(2), "2nd");
        assert_eq!(ordinal(3), "3rd");
        assert_eq!(ordinal(11), "11th");
        assert_eq!(ordinal(22), "22nd");
    }

    #[test]
    fn a_terminal_line_too_long_still_names_the_holder() {
        let holder = Party {
            pid: Some(10813),
            host: Some("vm".into()),
            command: Some("ch-image build --force -t app -f Dockerfile.app .".into()),
            since: Some(clock::now_ms()),
            stowage: Some(true),
            ..Party::unknown(crate::lock::Mode::Exclusive)
        };
        let mut line = Line {
            what: "read lock on image 'registry.example.com/app'".into(),
            started: Instant::now(),
            tty: true,
            place: Some((1, 3)),
            holders: vec![holder],
            host: "vm".into(),
        };
        let long = line.render_in(None);
        assert!(long.contains("(1st of 3 in queue)"), "{long}");
        assert!(long.contains("(ch-image build --force"), "{long}");
        for width in [100, 119] {
            let cut = line.render_in(Some(width));
            assert!(cut.chars().count() <= width, "{width}: {cut}");
            assert!(cut.contains("held by pid 10813"), "{width}: {cut}");
            assert!(cut.ends_with(" for 0s"), "{width}: {cut}");
        }
        // An 80-column terminal.
        line.what = "read lock on image 'app'".into();
        let cut = line.render_in(Some(79));
        assert!(cut.chars().count() <= 79, "{cut}");
        assert!(cut.contains("held by pid 10813"), "{cut}");
    }
}
