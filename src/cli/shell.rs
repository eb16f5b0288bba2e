//! Completion scripts (`stowage completions SHELL`) and manual pages (`stowage man DIR`, used by
//! `scripts/install`), both generated from the clap definitions.
//!
//! - Completion is dynamic: the script calls stowage back with the words typed so far
//!   (`_STOWAGE_COMPLETE`), so image names and slot classes come from the store.
//! - That callback never waits, writes or creates a root: it reads records and class files only.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Arg, Command};
use clap_complete::engine::{ArgValueCandidates, CompletionCandidate};
use clap_complete::env::{Bash, EnvCompleter, Fish, Zsh};

use crate::image_record::State;
use crate::root::Root;

/// Answers a completion callback and exits, if this run is one.
pub fn complete_if_asked(command: fn() -> Command) {
    if std::env::var_os(crate::env::COMPLETE).is_none() {
        return;
    }
    clap_complete::CompleteEnv::with_factory(move || with_candidates(command()))
        .var(crate::env::COMPLETE)
        .complete();
}

/// `stowage completions SHELL` (clap allows bash, zsh, fish): the script that `source` or fish loads.
pub fn write_completions(shell: &str, out: &mut dyn Write) -> Result<()> {
    let completer: &dyn EnvCompleter = match shell {
        "bash" => &Bash,
        "zsh" => &Zsh,
        _ => &Fish,
    };
    // The script calls the stowage on PATH: right across upgrades (the binary owns the protocol).
    completer
        .write_registration(crate::env::COMPLETE, "stowage", "stowage", "stowage", out)
        .context("cannot write the completion script")
}

/// `stowage man DIR`: stowage.1 and one page per subcommand, subcommands of subcommands too (a
/// page's SEE ALSO names them all).
pub fn write_man_pages(mut cmd: Command, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    cmd = without_help(cmd);
    cmd.build();
    let mut written = Vec::new();
    write_pages(&cmd, "stowage", dir, &mut written)?;
    Ok(written)
}

/// `cmd` without the `help` subcommands clap adds: `--help` is on every page, and a page named for
/// one would only repeat its parent's.
fn without_help(cmd: Command) -> Command {
    let subs: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    let cmd = cmd.disable_help_subcommand(true);
    subs.into_iter()
        .fold(cmd, |cmd, sub| cmd.mut_subcommand(sub, without_help))
}

/// `cmd`'s page as `name`, then its subcommands' as `name-SUB`, recursively.
fn write_pages(cmd: &Command, name: &str, dir: &Path, written: &mut Vec<PathBuf>) -> Result<()> {
    written.push(write_page(cmd, name, dir)?);
    for sub in cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
    {
        let name = format!("{name}-{}", sub.get_name());
        write_pages(&sub.clone().name(name.clone()), &name, dir, written)?;
    }
    Ok(())
}

fn write_page(cmd: &Command, name: &str, dir: &Path) -> Result<PathBuf> {
    let cmd = &cmd.clone().override_usage(synopsis(cmd));
    let man = clap_mangen::Man::new(cmd.clone())
        .title(name.to_uppercase())
        .section("1")
        .manual("stowage manual");
    let mut page = Vec::new();
    man.render_title(&mut page)?;
    man.render_name_section(&mut page)?;
    man.render_synopsis_section(&mut page)?;
    man.render_description_section(&mut page)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut page)?;
    }
    if cmd.has_subcommands() {
        man.render_subcommands_section(&mut page)?;
    }
    if let Some(text) = cmd.get_after_long_help().or_else(|| cmd.get_after_help()) {
        // Examples and notes, kept line for line as --help shows them.
        page.extend_from_slice(b".SH NOTES\n.nf\n");
        for line in text.to_string().lines() {
            page.extend_from_slice(roff_line(line).as_bytes());
            page.push(b'\n');
        }
        page.extend_from_slice(b".fi\n");
    }
    page.extend_from_slice(COMMON_SECTIONS.as_bytes());
    if name == "stowage" {
        page.extend_from_slice(SEE_ALSO.as_bytes());
    }
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, page).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// A no-fill block's line: `\` and `-` escaped, a leading `.` or `'` kept from being a request.
fn roff_line(line: &str) -> String {
    let escaped = line.replace('\\', "\\e").replace('-', "\\-");
    if escaped.starts_with('.') || escaped.starts_with('\'') {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

/// Exit status, environment and files: the same for every command.
const COMMON_SECTIONS: &str = r#".SH "EXIT STATUS"
.TP
\fB0\fR
Success (for \fBexec\fR: the command's own status).
.TP
\fB128+N\fR
\fBexec\fR: the command died of signal N.
.TP
\fB64\fR
Bad usage or an invalid image name.
.TP
\fB66\fR
No such image, or an image to read is not ready; a root that does not exist for a reading command.
.TP
\fB69\fR
Locking is unavailable or unsafe on the root's filesystem (e.g. NFS mounted with local locks).
.TP
\fB75\fR
A lock was not acquired in time (\fB\-\-wait\fR, \fB\-\-no\-wait\fR; \fBexec \-\-conflict\-exit\-code\fR changes it).
.TP
\fB1\fR
Any other failure. Every failure prints one line on standard error naming the object and the cause.
.SH ENVIRONMENT
.TP
\fBSTOWAGE_ROOT\fR
The store root when \fB\-\-root\fR is not given (default: /var/tmp/$USER.stowage).
.TP
\fBSTOWAGE_IMAGES_DIR\fR, \fBSTOWAGE_IMAGE_DIR\fR
Set by \fBexec\fR for its command: the images directory, and the directory of the one \fB\-\-write\fR image.
.TP
\fBSTOWAGE_NOW\fR
Seconds since the epoch to use as the current time (tests and gc rehearsals).
.SH FILES
.TP
\fIROOT\fB/stowage.db\fR
The catalog: names, lineage, last use, sizes (SQLite, rollback journal). Derived from the images' records and trees; \fBstowage doctor \-\-repair\fR rebuilds it.
.TP
\fIROOT\fB/locks/global.lock\fR
The global lock, held for one short metadata transaction at a time.
.TP
\fIROOT\fB/locks/images/\fIENC\fB.lock\fR
One flock(2) lock per image, holding its record (state, base, creation); ENC is the name with '/' as '%' and ':' as '+'. \fBflock\fR(1) can take the same lock: let it open the file, or open it with <> or <, never with > (that empties the record).
.TP
\fIROOT\fB/locks/slots/\fICLASS\fB/\fR
The lock files of a slot class.
.TP
\fIROOT\fB/img/\fIENC\fB/\fR
Image trees (unless \fBstowage init \-\-images\-dir\fR put them elsewhere).
.TP
\fIROOT\fB/trash/\fR
Removals in progress.
"#;

const SEE_ALSO: &str = r#".SH "SEE ALSO"
\fBflock\fR(1), \fBflock\fR(2), \fBch-image\fR(1)
"#;

/// The command line with image names and slot classes offered as values.
fn with_candidates(cmd: Command) -> Command {
    let images = |a: Arg| a.add(ArgValueCandidates::new(|| image_names(false)));
    let ready = |a: Arg| a.add(ArgValueCandidates::new(|| image_names(true)));
    let classes = |a: Arg| a.add(ArgValueCandidates::new(class_names));
    cmd.mut_subcommand("exec", |c| {
        c.mut_arg("read", ready)
            .mut_arg("from", ready)
            .mut_arg("write", images)
            .mut_arg("slot", classes)
    })
    .mut_subcommand("rm", |c| c.mut_arg("images", images))
    .mut_subcommand("lock-status", |c| c.mut_arg("images", images))
    .mut_subcommand("slots", |c| {
        c.mut_subcommand("set", |c| c.mut_arg("class", classes))
            .mut_subcommand("rm", |c| c.mut_arg("class", classes))
    })
}

/// Image names (only ready ones if `ready`) from the records: no lock, no wait, nothing created.
fn image_names(ready: bool) -> Vec<CompletionCandidate> {
    let entries = completion_root().and_then(|r| crate::census::take(&r).ok());
    let wanted = |e: &crate::census::Entry| !ready || e.state() == Some(State::Ready);
    let names = entries.unwrap_or_default().into_iter().filter(wanted);
    let mut names: Vec<String> = names.filter_map(|e| e.name().map(str::to_owned)).collect();
    names.sort();
    names.into_iter().map(CompletionCandidate::new).collect()
}

/// Slot classes with limits, from their files.
fn class_names() -> Vec<CompletionCandidate> {
    let classes = completion_root().map(|r| crate::slots::configured(&r));
    let classes = classes.unwrap_or_default().into_iter();
    classes.map(CompletionCandidate::new).collect()
}

/// The root the completed line names (`--root DIR`, `--root=DIR`), else the default; never created.
fn completion_root() -> Option<Root> {
    // The callback's arguments: `stowage -- stowage [WORD...]`.
    let words: Vec<OsString> = std::env::args_os()
        .skip(1)
        .skip_while(|w| w != "--")
        .skip(2)
        // After exec's `--` come the command's words, not ours.
        .take_while(|w| w != "--")
        .collect();
    let mut flag = None;
    for (i, w) in words.iter().enumerate() {
        let w = w.to_string_lossy();
        if w == "--root" {
            flag = words.get(i + 1).map(PathBuf::from);
        } else if let Some(v) = w.strip_prefix("--root=") {
            flag = Some(PathBuf::from(v));
        }
    }
    let root = Root::resolve(flag.as_deref()).ok()?;
    root.image_locks().is_dir().then_some(root)
}

/// The SYNOPSIS line with each option's value names and the `--` before the command: clap_mangen's
/// own drops both, and `exec` is unusable without the `--`.
fn synopsis(cmd: &Command) -> String {
    let name = cmd.get_bin_name().unwrap_or_else(|| cmd.get_name());
    let mut words = vec![name.to_owned()];
    // Options first, the command's operands (and the `--`) last, as one types them.
    let args = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !a.is_positional());
    for arg in args.chain(cmd.get_positionals().filter(|a| !a.is_hide_set())) {
        let values = arg.get_value_names().map(|v| v.join(" "));
        let word = if arg.is_positional() {
            let many = arg.get_num_args().is_some_and(|n| n.max_values() > 1);
            let v = values.unwrap_or_else(|| arg.get_id().to_string());
            let v = format!("<{v}>{}", if many { "..." } else { "" });
            if arg.is_last_set() {
                format!("-- {v}")
            } else {
                v
            }
        } else {
            let flag = match (arg.get_short(), arg.get_long()) {
                (Some(s), Some(l)) => format!("-{s}|--{l}"),
                (Some(s), None) => format!("-{s}"),
                (None, Some(l)) => format!("--{l}"),
                (None, None) => continue,
            };
            match values.filter(|_| arg.get_action().takes_values()) {
                Some(v) => format!("{flag} {v}"),
                None => flag,
            }
        };
        words.push(match arg.is_required_set() {
            true => word,
            false => format!("[{word}]"),
        });
    }
    words.join(" ")
}
