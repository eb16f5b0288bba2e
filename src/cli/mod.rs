//! The command line: parsing and dispatch here, one file per command beside it; errors become one
//! line on stderr and an exit code here and nowhere else.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};

use crate::error::{self, Error};
use crate::ident::lossy;
use crate::name::ImageName;
use crate::root::Root;
use crate::store::Store;

/// `eprintln!` that never panics: with stderr gone, an exec must still exit with its contract's
/// code, not a panic's 101. Defined before the command modules, which use it.
macro_rules! complain {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        // One line, nothing in it that drives the terminal (a name may hold an escape sequence).
        let line = crate::error::without_errno(&format!($($arg)*));
        let _ = writeln!(std::io::stderr(), "{}", crate::ident::printable(&line));
    }};
}

#[macro_use]
mod duration;
mod doctor;
mod exec;
mod gc;
mod images;
mod init;
mod lock_status;
mod rm;
mod shell;
mod slots;
mod why;

#[derive(Parser)]
#[command(
    name = "stowage",
    version,
    about = "Locks and storage for a shared directory of build images",
    long_about = "Locks and storage for a shared directory of build images.\n\n\
        Builds call 'stowage exec --read BASE --write NEW -- BUILDER ...': shared locks on the \
        images they read, exclusive locks on the images they write, so parallel builds share \
        base images safely. 'stowage lock-status' shows who holds what.",
    next_help_heading = "Global options"
)]
struct Cli {
    /// The storage root [default: $STOWAGE_ROOT, else /var/tmp/$USER.stowage]
    #[arg(long, global = true, value_name = "DIR")]
    root: Option<PathBuf>,
    /// Say more about what is happening
    #[arg(short, long, global = true)]
    verbose: bool,
    /// No progress or waiting messages on stderr; reports on stdout, errors, and the line saying a
    /// command was skipped (--conflict-exit-code) still print
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the layout and adopt existing image directories
    Init(init::Args),
    /// Run a command holding image locks
    Exec(exec::Args),
    /// List images
    #[command(visible_alias = "ls")]
    Images(images::Args),
    /// Show who holds and awaits which lock
    LockStatus(lock_status::Args),
    /// Remove images (each under its write lock)
    Rm(rm::Args),
    /// Remove incomplete, unused and least recently used images
    Gc(gc::Args),
    /// Show or configure slot classes (limits on heavy work per runtime)
    Slots(slots::Args),
    /// Check the store (flock, database, consistency) and repair it
    Doctor(doctor::Args),
    /// Print a shell completion script (bash, zsh, fish)
    #[command(after_help = "Load it with, e.g.:\n  \
        bash:  source <(stowage completions bash)     (or save it to\n         \
        /usr/share/bash-completion/completions/stowage)\n  \
        zsh:   source <(stowage completions zsh)\n  \
        fish:  stowage completions fish > ~/.config/fish/completions/stowage.fish\n\
        Image names and slot classes complete from the store, without waiting on any lock.")]
    Completions {
        /// bash, zsh or fish
        #[arg(value_parser = ["bash", "zsh", "fish"])]
        shell: String,
    },
    /// Write the manual pages (stowage.1, stowage-COMMAND.1) into DIR
    #[command(hide = true)]
    Man {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
}

pub fn main() -> ExitCode {
    // No descriptor is opened for it: before the inherited ones are noted.
    crate::dir::raise_open_files();
    crate::kernel::note_inherited();
    let args: Vec<OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == crate::keeper::ARG) {
        return ExitCode::from(crate::keeper::main(&args[2..]));
    }
    shell::complete_if_asked(Cli::command);
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => return parse_failure(e, &args),
    };
    // SIGPIPE stays ignored: an exec outlives a gone reader to record its outcome.
    let result = run(cli).map_err(init::with_refusal);
    // Every lock of ours is closed by now: the lease goes too (one unlink).
    crate::lease::retire();
    exit_with(result)
}

/// The exit code for `result`, and its one line on stderr; none when stdout's reader has gone.
fn exit_with(result: Result<u8>) -> ExitCode {
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if !matches!(error::typed(&e), Some(Error::ReaderGone)) {
                complain!("stowage: {}{}", error::one_line(&e), advice(&e));
            }
            ExitCode::from(error::exit_code(&e))
        }
    }
}

/// What to do when out of file descriptors (a deep `--from` copy keeps two per level).
fn advice(err: &anyhow::Error) -> String {
    let errno = err
        .chain()
        .find_map(|c| c.downcast_ref::<std::io::Error>()?.raw_os_error());
    match errno {
        Some(libc::EMFILE) => {
            use nix::sys::resource::{Resource, getrlimit};
            let limit = getrlimit(Resource::RLIMIT_NOFILE).map_or_else(
                |_| String::new(),
                |(soft, hard)| format!(" of {soft} (hard limit {hard})"),
            );
            format!(
                " — this process reached its limit{limit} on open files: raise it with 'ulimit -n' and try again"
            )
        }
        Some(libc::ENFILE) => {
            " — the system ran out of open files (fs.file-max): try again when fewer are open"
                .into()
        }
        _ => String::new(),
    }
}

fn run(cli: Cli) -> Result<u8> {
    // These describe the program, not a store: no root is looked at.
    match &cli.command {
        Command::Completions { shell } => {
            let mut script = Vec::new();
            shell::write_completions(shell, &mut script)?;
            return print(&String::from_utf8_lossy(&script)).map(|()| 0);
        }
        Command::Man { dir } => {
            let pages = shell::write_man_pages(Cli::command(), dir)?;
            for page in pages.iter().filter(|_| cli.verbose) {
                complain!("stowage: wrote {}", page.display());
            }
            return Ok(0);
        }
        _ => {}
    }
    // Before anything is recorded: a clock in the wrong unit would write times none can show.
    crate::clock::check_env()?;
    let mut root = Root::resolve(cli.root.as_deref())?;
    let sharing = root.check()?;
    if !matches!(cli.command, Command::Doctor(_)) {
        root.check_locking()?;
    }
    let mut store = Store::new(root);
    let ctx = store.ctx_mut();
    // Only these create a missing root: a mistyped root in a cron job must not grow a store.
    ctx.creates_root = match &cli.command {
        Command::Init(_) | Command::Exec(_) => true,
        Command::Slots(a) => matches!(a.action, Some(slots::Action::Set { .. })),
        _ => false,
    };
    // A later release's store (its configuration, its catalog's schema) is refused before anything
    // reads or writes it. `exec`, whose calls the contract counts, reads the configuration only
    // before a new image's lock file or a store-wide hold: of an existing image it learns a later
    // release's hand from the image's record; doctor reports it.
    if !matches!(cli.command, Command::Exec(_) | Command::Doctor(_)) {
        store.root().refuse_newer()?;
        crate::catalog::refuse_newer(store.root())?;
    }
    let ctx = store.ctx_mut();
    ctx.quiet = cli.quiet;
    ctx.verbose = cli.verbose;
    // What we create in a group's store must be usable by the group; the command gets the umask.
    ctx.child_umask = sharing.then(crate::sharing::open_umask);
    let done = match cli.command {
        Command::Init(args) => init::run(args, &mut store),
        Command::Exec(args) => exec::run(args, &mut store),
        Command::Images(args) => images::run(args, &mut store),
        Command::LockStatus(args) => lock_status::run(args, &mut store),
        Command::Slots(args) => slots::run(args, &mut store),
        Command::Rm(args) => rm::run(args, &mut store),
        Command::Gc(args) => gc::run(args, &mut store),
        Command::Doctor(args) => doctor::run(args, &mut store),
        Command::Completions { .. } | Command::Man { .. } => unreachable!("handled above"),
    };
    done.map_err(|e| erased_record(store.root(), e))
}

/// An image said not to exist whose record an opener erased (its tree is there) is said so: the
/// one cause a user can act on, asked only once the command failed.
fn erased_record(root: &Root, e: anyhow::Error) -> anyhow::Error {
    let Some(Error::NoSuchImage(names)) = error::typed(&e) else {
        return e;
    };
    let names = names
        .iter()
        .filter_map(|n| crate::name::ImageName::parse(n).ok());
    match names
        .into_iter()
        .find(|n| crate::images_dir::record_erased(root, n) == Some(true))
    {
        Some(n) => Error::RecordErased {
            lock: root.image_lock(&n),
            name: n.as_str().to_owned(),
        }
        .into(),
        None => e,
    }
}

/// Whether standard output was closed when the process started ([`note_closed_stdout`]).
static STDOUT_CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Notes whether standard output is closed, before the Rust runtime puts /dev/null in its place
/// (then every write would succeed, and a report be lost without a word, a `--watch` never end).
/// Run from `.init_array`, as the C library does before `main`: no allocation, no panic.
extern "C" fn note_closed_stdout() {
    // SAFETY: F_GETFD reads a descriptor's flags; it touches no memory of ours.
    let closed = unsafe { libc::fcntl(libc::STDOUT_FILENO, libc::F_GETFD) } == -1
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::EBADF);
    STDOUT_CLOSED.store(closed, std::sync::atomic::Ordering::Relaxed);
}

#[used]
#[unsafe(link_section = ".init_array")]
static NOTE_CLOSED_STDOUT: extern "C" fn() = note_closed_stdout;

/// Writes `text` to stdout and flushes it (never `println!`, which panics): a failed write is a
/// one-line error, exit 1 (stdout closed too); a reader gone (`| head`) ends the command quietly.
pub(crate) fn print(text: &str) -> Result<()> {
    use std::io::Write;
    if STDOUT_CLOSED.load(std::sync::atomic::Ordering::Relaxed) && !text.is_empty() {
        let e = std::io::Error::from_raw_os_error(libc::EBADF);
        anyhow::bail!("cannot write to standard output: {e}");
    }
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => Error::ReaderGone.into(),
            _ => anyhow::anyhow!("cannot write to standard output: {e}"),
        })
}

/// [`print`]s `doc` as pretty JSON, one line break after it.
pub(crate) fn print_json(doc: &impl serde::Serialize) -> Result<()> {
    print(&format!("{}\n", json_text(doc, true)?))
}

/// `doc` as JSON with every character that could drive a terminal escaped (`\u009b`), where the
/// encoder escapes C0 controls only; they only occur inside strings, so the values read the same.
pub(crate) fn json_text(doc: &impl serde::Serialize, pretty: bool) -> Result<String> {
    let text = if pretty {
        serde_json::to_string_pretty(doc)?
    } else {
        serde_json::to_string(doc)?
    };
    // A raw newline is the pretty layout's: the encoder escapes every one in a string.
    let risky = |c: char| c != '\n' && crate::ident::risky(c);
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            // All in the Basic Multilingual Plane: one `\uXXXX` each.
            c if risky(c) => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Help and version go to stdout, exit 0; anything else is a usage error, exit 64, in one line with
/// clap's suggestion.
fn parse_failure(e: clap::Error, args: &[OsString]) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            return exit_with(print(&e.render().to_string()).map(|()| 0));
        }
        // `stowage` alone (or with flags only): one line as every usage error, not the whole help.
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            let at =
                subcommand(args).map_or_else(|| "stowage".into(), |(n, _)| format!("stowage {n}"));
            complain!("stowage: missing subcommand; see '{at} --help'");
        }
        _ => complain!("stowage: {}", usage_line(&e, args)),
    }
    ExitCode::from(error::code::USAGE)
}

/// A usage error in one line: what, clap's suggestion, where help is (or a fix for a mistake clap
/// misreads).
fn usage_line(e: &clap::Error, args: &[OsString]) -> String {
    use clap::error::{ContextKind, ErrorKind};
    if let Some(line) = misplaced(e, args) {
        return line;
    }
    let sub = subcommand(args);
    let exec = sub
        .as_ref()
        .filter(|(name, _)| name == "exec")
        .map(|(_, at)| *at);
    let invalid = context(e, ContextKind::InvalidArg);
    if e.kind() == ErrorKind::UnknownArgument
        && let Some(at) = exec
        && let Some(arg) = invalid.as_deref().filter(|a| !a.starts_with('-'))
    {
        return command_before_dashes(args, at, arg);
    }
    if e.kind() == ErrorKind::MissingRequiredArgument
        && exec.is_some()
        && invalid.is_some_and(|a| a.contains("CMD"))
    {
        return format!("no command to run: put it after '--' ({EXEC_USAGE})");
    }
    let what = given_empty(e, args).unwrap_or_else(|| what_clap_says(e));
    let hint = context(e, ContextKind::SuggestedArg)
        .or_else(|| context(e, ContextKind::SuggestedSubcommand))
        .map_or_else(String::new, |s| format!("; did you mean '{s}'?"));
    // The help page the mistake is on: a subcommand's own (`slots set`, or `slots` for `slots foo`).
    let page = sub.map_or_else(String::new, |(name, at)| {
        let nested = args.get(at + 1).and_then(|a| a.to_str()).filter(|a| {
            Cli::command()
                .find_subcommand(&name)
                .is_some_and(|c| c.find_subcommand(a).is_some())
        });
        nested.map_or_else(|| format!(" {name}"), |n| format!(" {name} {n}"))
    });
    format!("{what}{hint} (see 'stowage{page} --help')")
}

/// The two mistakes clap's message misplaces: an option's value forgotten just before `--` (taken
/// as the value), and a subcommand's option given before its name.
fn misplaced(e: &clap::Error, args: &[OsString]) -> Option<String> {
    let words = lossy(args);
    let cli = Cli::command();
    let sub = (1..words.len()).find(|&i| cli.find_subcommand(&words[i]).is_some());
    if let Some(at) = sub
        && let Some(dashes) = words.iter().skip(at + 1).position(|w| w == "--")
    {
        let before = &words[at + dashes];
        let takes = cli
            .find_subcommand(&words[at])
            .is_some_and(|c| takes_value(c, before))
            || takes_value(&cli, before);
        if dashes > 0 && takes {
            return Some(format!(
                "{before} is missing its value: the '--' after it was taken as its value (e.g. {before} {} -- CMD; see 'stowage {} --help')",
                example_value(before),
                words[at]
            ));
        }
    }
    let invalid = context(e, clap::error::ContextKind::InvalidArg)?;
    let flag = invalid.split('=').next().unwrap_or(&invalid).to_owned();
    let with_value = format!("{flag}=");
    let first =
        (1..words.len()).find(|&i| words[i] == flag || words[i].starts_with(&with_value))?;
    if !flag.starts_with('-') || sub.is_some_and(|s| s < first) {
        return None;
    }
    let owner = cli.get_subcommands().find(|c| {
        c.get_arguments()
            .any(|a| a.get_long() == flag.strip_prefix("--"))
    })?;
    let name = owner.get_name();
    let span = 1 + usize::from(!words[first].contains('=') && takes_value(owner, &flag));
    let mut fixed: Vec<String> = words[1..].to_vec();
    let moved: Vec<String> = fixed
        .drain(first - 1..(first - 1 + span).min(fixed.len()))
        .collect();
    let at = fixed
        .iter()
        .position(|w| w == name)
        .map_or(fixed.len(), |i| i + 1);
    fixed.splice(at..at, moved);
    Some(format!(
        "{flag} is an option of 'stowage {name}': put it after '{name}', as in: stowage {} (see 'stowage {name} --help')",
        crate::ident::shell_join(&fixed)
    ))
}

/// clap's first paragraph, which says what is wrong, in one line; the argument it quotes is
/// escaped first (a newline in it would be taken for clap's).
fn what_clap_says(e: &clap::Error) -> String {
    use clap::error::ContextKind;
    let mut text = e.render().to_string();
    for kind in [
        ContextKind::InvalidArg,
        ContextKind::InvalidValue,
        ContextKind::InvalidSubcommand,
    ] {
        if let Some(arg) = context(e, kind).filter(|a| a.contains('\n')) {
            let shown = format!("'{}'", crate::ident::printable(&arg));
            text = text.replacen(&format!("'{arg}'"), &shown, 1);
        }
    }
    let what: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let what = what.join(" ");
    what.strip_prefix("error: ").unwrap_or(&what).to_owned()
}

/// An empty value given (`--root "$UNSET"`), which clap calls "none was supplied": said as empty.
fn given_empty(e: &clap::Error, args: &[OsString]) -> Option<String> {
    use clap::error::{ContextKind, ErrorKind};
    if e.kind() != ErrorKind::InvalidValue || !context(e, ContextKind::InvalidValue)?.is_empty() {
        return None;
    }
    // `--root <DIR>`, or `<SHELL>` for an argument by position.
    let arg = context(e, ContextKind::InvalidArg)?;
    let (flag, value) = match arg.split_once(' ') {
        Some((flag, value)) => (Some(flag), value),
        None => (None, arg.as_str()),
    };
    let value = value.trim_start_matches('<').trim_end_matches(['>', '.']);
    let given = match flag {
        Some(flag) => args.windows(2).any(|w| w[0] == flag && w[1].is_empty()),
        None => args.iter().skip(1).any(|a| a.is_empty()),
    } || flag.is_some_and(|f| args.iter().any(|a| *a == *format!("{f}=")));
    let named = flag.map_or_else(String::new, |f| format!("{f}: "));
    given.then(|| format!("{named}the {value} given is empty (is a variable unset?)"))
}

/// Whether `flag` (`--wait`) is an option of `cmd` that takes a value.
fn takes_value(cmd: &clap::Command, flag: &str) -> bool {
    flag.strip_prefix("--").is_some_and(|long| {
        cmd.get_arguments()
            .any(|a| a.get_long() == Some(long) && a.get_action().takes_values())
    })
}

/// A value to show in the fix for an option that lost its value.
fn example_value(flag: &str) -> &'static str {
    match flag {
        "--wait" => "30",
        "--conflict-exit-code" => "99",
        "--priority" => "high",
        "--slot" => "pull",
        "--root" => "DIR",
        _ => "IMG",
    }
}

/// A value clap attached to its error; of several (suggestions), the last: clap lists the most similar last.
fn context(e: &clap::Error, kind: clap::error::ContextKind) -> Option<String> {
    use clap::error::ContextValue;
    match e.get(kind) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        Some(ContextValue::Strings(v)) => v.last().cloned(),
        _ => None,
    }
}

/// `stowage exec --write app ch-image build …`: shows the line with the command after `--`.
fn command_before_dashes(args: &[OsString], at: usize, arg: &str) -> String {
    let mut fixed = lossy(&args[1..]);
    match command_start(args, at) {
        Some(p) if args[p] == arg && !args.iter().any(|a| a == "--") => {
            fixed.insert(p - 1, "--".into());
            format!(
                "unexpected argument '{arg}': put the command after '--', as in: stowage {} ({EXEC_USAGE})",
                crate::ident::shell_join(&fixed)
            )
        }
        _ => format!(
            "unexpected argument '{arg}' before '--': only options go there, the command after '--' ({EXEC_USAGE})"
        ),
    }
}

/// The index of the command's first word given to exec (at `at`) without `--`.
fn command_start(args: &[OsString], at: usize) -> Option<usize> {
    let cli = Cli::command();
    let exec = cli.find_subcommand("exec")?;
    let mut i = at + 1;
    while i < args.len() {
        let a = args[i].to_string_lossy();
        if a == "--" {
            return None;
        }
        if !a.starts_with('-') || a == "-" {
            return Some(i);
        }
        let value = !a.contains('=') && (takes_value(exec, &a) || takes_value(&cli, &a));
        i += if value { 2 } else { 1 };
    }
    None
}

/// exec's usage, for the mistakes made with it (one line, as every error).
const EXEC_USAGE: &str = "usage: stowage exec [OPTIONS] -- CMD [ARG]...";

/// The subcommand named on the command line and its index: the first argument that is neither a
/// global option nor its value, if it names one.
fn subcommand(args: &[OsString]) -> Option<(String, usize)> {
    let mut i = 1;
    while i < args.len() {
        let a = args[i].to_str()?;
        match a {
            "--root" => i += 2,
            _ if a.starts_with('-') => i += 1,
            _ => {
                return Cli::command()
                    .find_subcommand(a)
                    .map(|c| (c.get_name().to_owned(), i));
            }
        }
    }
    None
}

fn names(raw: &[OsString]) -> Result<Vec<ImageName>> {
    raw.iter()
        .map(|r| ImageName::parse_os(r).map_err(|e| Error::from(e).into()))
        .collect()
}

/// Refuses the command line: a usage error (exit 64) saying `why`.
fn usage<T>(why: String) -> Result<T> {
    Err(Error::Usage(why).into())
}

/// Rows as left-aligned columns two spaces apart; the last is not padded, no line ends in spaces.
fn table<const N: usize>(rows: &[[String; N]]) -> String {
    // A cell may hold a forged record's text: no terminal control codes.
    let rows: Vec<[std::borrow::Cow<str>; N]> = rows
        .iter()
        .map(|r| std::array::from_fn(|i| crate::ident::printable(&r[i])))
        .collect();
    let widths: [usize; N] =
        std::array::from_fn(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0));
    rows.iter()
        .map(|row| {
            let cells = row.iter().zip(widths);
            let line: String = cells.map(|(c, w)| format!("{c:<w$}  ")).collect();
            format!("{}\n", line.trim_end())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each argument that takes a value, by the name of its value, of every command: a number,
    /// size or time takes a leading '-' as its value, so its own rule refuses `-5G` whole (clap
    /// would take `-5` for an option). A new argument must be sorted here to pass.
    #[test]
    fn every_number_size_or_time_takes_a_leading_hyphen_as_its_value() {
        // A group may be given by number: `-1` is its value, refused by its own rule.
        const NUMBERS: [&str; 7] = [
            "SECONDS", "DURATION", "SIZE", "N", "LIMIT", "IMG|PID", "GROUP",
        ];
        const OTHERS: [&str; 7] = ["IMG", "BASE", "CLASS", "PRIORITY", "DIR", "CMD", "SHELL"];
        fn walk(cmd: &clap::Command, at: &str, seen: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                if !a.get_action().takes_values() {
                    continue;
                }
                let names = a.get_value_names().unwrap_or_default();
                let name = names.first().map_or_else(String::new, |n| n.to_string());
                let what = format!("{at} {}: {name}", a.get_id());
                if NUMBERS.contains(&name.as_str()) {
                    assert!(a.is_allow_hyphen_values_set(), "{what}: '-1' is its value");
                } else {
                    assert!(OTHERS.contains(&name.as_str()), "{what}: a number or not?");
                }
                seen.push(name);
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{at} {}", sub.get_name()), seen);
            }
        }
        let mut seen = Vec::new();
        walk(&Cli::command(), "stowage", &mut seen);
        for n in NUMBERS {
            assert!(seen.iter().any(|s| s == n), "{n} is a value of none");
        }
    }
}
