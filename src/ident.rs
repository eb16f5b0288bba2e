//! Who a process is, as recorded next to the locks it holds or awaits.
//!
//! - A record is information, never the truth about a lock (the kernel is).
//! - Its liveness is its owner's lease (`lease.rs`): a pid means nothing on another host or in
//!   another pid namespace.
//! - How a hint names stowage: with the `--root` the user gave, so that it acts on this root.

use std::fs;

/// The identity this process records.
#[derive(Debug, Clone)]
pub struct Me {
    pub pid: u32,
    pub host: String,
    pub boot_id: Option<String>,
    pub user: String,
}

impl Me {
    /// This process's identity, looked up once per process (it reads /proc, the boot id, the host
    /// name and the user database; the store and the lease both ask).
    pub fn current() -> Me {
        static ME: std::sync::Mutex<Option<Me>> = std::sync::Mutex::new(None);
        let pid = std::process::id();
        let mut cached = ME.lock().unwrap_or_else(|e| e.into_inner());
        // A forked child is another process: it looks itself up.
        cached.take_if(|me| me.pid != pid);
        cached
            .get_or_insert_with(|| Me {
                pid,
                // Of this UTS namespace: a container's own.
                host: nix::unistd::gethostname()
                    .ok()
                    .and_then(|h| h.into_string().ok())
                    .unwrap_or_else(|| "localhost".to_owned()),
                boot_id: fs::read_to_string("/proc/sys/kernel/random/boot_id")
                    .ok()
                    .map(|s| s.trim().to_owned()),
                user: account_name(),
            })
            .clone()
    }
}

/// 64 random bits, for a name no other process on any host makes (a pid alone is no identity:
/// hosts and containers each count their own).
pub fn nonce() -> u64 {
    let mut buf = [0u8; 8];
    // SAFETY: getrandom writes at most buf.len() bytes into buf.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), libc::GRND_NONBLOCK) };
    if n == buf.len() as isize {
        return u64::from_ne_bytes(buf);
    }
    // No entropy yet (early boot): time and pid still make a fresh name; a clash costs a retry.
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

/// `$USER`, else the password file, else the numeric uid: what the default root is named by
/// (`/var/tmp/$USER.stowage`, as the contract says).
pub fn user_name() -> String {
    let user = std::env::var("USER").ok().filter(|u| !u.is_empty());
    user.unwrap_or_else(|| user_name_of(nix::unistd::getuid().as_raw()))
}

/// Who this process is, as its leases and records say: its uid's name in the password file, else
/// `$USER` (a user the file does not list, from a directory service), else the uid. `$USER` is
/// what a session started as (`su` keeps it), not who runs: two holders of one uid, one name.
pub fn account_name() -> String {
    let uid = nix::unistd::geteuid().as_raw();
    let text = passwd_text();
    let listed = |name: &str| {
        text.as_deref()
            .is_some_and(|t| id_entries(t).any(|e| e.0 == name))
    };
    // A name the file gives another uid is not this one's, whatever `$USER` says.
    let user = || {
        std::env::var("USER")
            .ok()
            .filter(|u| !u.is_empty() && !listed(u))
    };
    (text.as_deref().and_then(|t| name_in_passwd(t, uid)))
        .or_else(user)
        .unwrap_or_else(|| uid.to_string())
}

/// A user as a message names them: `user 'ana' (uid 1000)`, or `uid 1000` when unnamed.
pub fn someone(uid: u32) -> String {
    match passwd_name(uid) {
        Some(name) => format!("user '{name}' (uid {uid})"),
        None => format!("uid {uid}"),
    }
}

/// The name `/etc/passwd` gives `uid`, else the uid itself.
fn user_name_of(uid: u32) -> String {
    passwd_name(uid).unwrap_or_else(|| uid.to_string())
}

/// The name `/etc/passwd` gives `uid`. Never asked of the C library: a static binary's `getpwuid`
/// loads the host's NSS modules, which crash it.
pub fn passwd_name(uid: u32) -> Option<String> {
    name_in_passwd(&passwd_text()?, uid)
}

/// The text of `/etc/passwd`; bounded: a planted or huge file costs at most 4 MiB.
fn passwd_text() -> Option<String> {
    let mut text = String::new();
    let file = std::os::unix::fs::OpenOptionsExt::custom_flags(
        fs::OpenOptions::new().read(true),
        libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC,
    )
    .open("/etc/passwd")
    .ok()?;
    std::io::Read::read_to_string(&mut std::io::Read::take(file, 4 << 20), &mut text).ok()?;
    Some(text)
}

/// The name of `uid` in the text of a password file (not a comment, nor an NIS `+`/`-` line).
fn name_in_passwd(text: &str, uid: u32) -> Option<String> {
    Some(fields_of(text, uid)?[0].to_owned())
}

/// Whether user `uid` is in group `gid` by `/etc/passwd` (its primary group) and `/etc/group` (its
/// members), read directly; `None` where they do not know the user or the group.
pub fn user_in_group(uid: u32, gid: u32) -> Option<bool> {
    let text = passwd_text()?;
    let user = fields_of(&text, uid)?;
    if user.get(3).and_then(|g| g.parse().ok()) == Some(gid) {
        return Some(true);
    }
    let groups = std::fs::read_to_string("/etc/group").ok()?;
    let members = fields_of(&groups, gid)?.get(3).copied().unwrap_or_default();
    Some(members.split(',').any(|m| m == user[0]))
}

/// The fields of the line of a password or group file that numbers `id` (not a comment, nor an
/// NIS `+`/`-` line), as [`id_entries`] reads them.
fn fields_of(text: &str, id: u32) -> Option<Vec<&str>> {
    let skipped = |name: &str| name.is_empty() || name.starts_with(['#', '+', '-']);
    let line = text.lines().find(|l| {
        let f: Vec<&str> = l.split(':').collect();
        !skipped(f[0]) && f.get(2).and_then(|n| n.parse().ok()) == Some(id)
    })?;
    Some(line.split(':').collect())
}

/// "'users' (100)", by `/etc/group` (read directly: a static binary has no NSS); the number alone
/// for a group it does not name.
pub fn group_label(gid: u32) -> String {
    let text = std::fs::read_to_string("/etc/group").unwrap_or_default();
    let name = id_entries(&text)
        .find(|&(_, g)| g == gid)
        .map(|(n, _)| n.to_owned());
    name.map_or_else(|| gid.to_string(), |n| format!("'{n}' ({gid})"))
}

/// Each line's name and number in the text of a password or group file (`name:x:ID:…`).
pub fn id_entries(text: &str) -> impl Iterator<Item = (&str, u32)> {
    text.lines().filter_map(|l| {
        let mut f = l.split(':');
        Some((f.next()?, f.nth(1)?.parse().ok()?))
    })
}

/// Field 22 of /proc/PID/stat: start time in clock ticks since boot. None when the process is gone
/// or a zombie (which holds no locks). `"self"`: this process, whatever /proc's pid namespace.
pub fn start_time(pid: impl std::fmt::Display) -> Option<u64> {
    let rest = stat_fields(pid)?;
    let mut fields = rest.split_whitespace();
    if matches!(fields.next()?, "Z" | "X") {
        return None;
    }
    // `rest` starts at field 3 (state); field 22 is 19 further on.
    fields.nth(18)?.parse().ok()
}

/// `/proc/PID/stat` from field 3 (the state) on, after the last `)` (the command name may hold
/// spaces and parentheses); None when the process is gone.
pub fn stat_fields(pid: impl std::fmt::Display) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat[stat.rfind(')')? + 1..].to_owned())
}

/// The entries of `dir` named by a number (processes in /proc, descriptors in /proc/PID/fd), each
/// with its number, as the listing goes.
pub fn numbered<T: std::str::FromStr>(
    dir: impl AsRef<std::path::Path>,
) -> std::io::Result<impl Iterator<Item = (T, fs::DirEntry)>> {
    let named = |e: fs::DirEntry| Some((e.file_name().to_str()?.parse().ok()?, e));
    Ok(fs::read_dir(dir)?.flatten().filter_map(named))
}

/// The command line of a local process, for showing holders that stowage did not start.
pub fn command_line(pid: u32) -> Option<String> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    (!args.is_empty()).then(|| shell_join(&args))
}

/// Is a local process running this same stowage executable? (The global lock has no records: its
/// holders are recognised by what they run.)
pub fn runs_stowage(pid: u32) -> bool {
    let theirs = fs::read_link(format!("/proc/{pid}/exe"));
    let ours = fs::read_link("/proc/self/exe");
    matches!((theirs, ours), (Ok(a), Ok(b)) if a == b)
}

/// Whether `/proc` is our pid namespace's: else (`unshare --pid` without a `/proc` of its own)
/// its pids number another namespace's processes, and nothing read there is of ours.
pub fn proc_is_ours() -> bool {
    let me = fs::read_link("/proc/self").ok();
    me.and_then(|p| p.to_str()?.parse::<u32>().ok()) == Some(std::process::id())
}

/// Whether a process `pid` of this pid namespace exists (kill(2) with no signal: /proc may hide
/// other users' processes). A zombie exists until reaped.
pub fn process_exists(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    pid > 0
        && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            != Err(nix::errno::Errno::ESRCH)
}

/// The owner of a local process.
pub fn process_user(pid: u32) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let uid = fs::metadata(format!("/proc/{pid}")).ok()?.uid();
    Some(user_name_of(uid))
}

/// Whether `c` printed raw could drive a terminal or reorder what it shows: a control character
/// (C0 or C1), a bidirectional override or mark, a line or paragraph separator.
pub fn risky(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{2028}' | '\u{2029}')
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// A recorded command, host or user name (from other users' processes) as it may be printed on a
/// terminal: each [`risky`] character as a visible escape (`\n`, `\x1b`, `\u{202e}`), everything
/// else kept, backslashes too (a `$'…'` word to paste must stay whole). JSON has its own.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(risky) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if risky(c) && (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if risky(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A path as one word a shell reads back as it, for a command a message tells the user to run: as
/// it is, else in single quotes, or where it holds a [`risky`] character or bytes that are not
/// UTF-8, in bash's `$'…'` with them escaped (which no printer changes).
pub fn shell_path(path: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    match path.to_str() {
        Some(s) if !s.chars().any(risky) => quote(s),
        _ => dollar_quoted(path.as_os_str().as_bytes()),
    }
}

/// `bytes` in bash's `$'…'`, what [`risky`] names and bytes that are not UTF-8 escaped: ASCII only.
fn dollar_quoted(bytes: &[u8]) -> String {
    let mut out = String::from("$'");
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' | '\'' => {
                    out.push('\\');
                    out.push(c);
                }
                '\n' => out.push_str("\\n"),
                '\t' => out.push_str("\\t"),
                // Byte by byte: `\xNN` is one byte to bash, and a C1 control is two in UTF-8.
                c if risky(c) => {
                    for b in c.encode_utf8(&mut [0; 4]).bytes() {
                        out.push_str(&format!("\\x{b:02x}"));
                    }
                }
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out.push('\'');
    out
}

/// Whether this process has group `gid` (its own or a supplementary one).
pub fn in_group(gid: u32) -> bool {
    let gid = nix::unistd::Gid::from_raw(gid);
    nix::unistd::getegid() == gid || nix::unistd::getgroups().is_ok_and(|g| g.contains(&gid))
}

/// `s` cut to `max` characters, the last of them `…` where it was cut.
pub fn shortened(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    let cut: String = s.chars().take(max - 1).collect();
    format!("{cut}…")
}

/// Arguments as text, any invalid UTF-8 replaced.
pub(crate) fn lossy(args: &[std::ffi::OsString]) -> Vec<String> {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// Joins arguments into one line a user could paste into a shell.
pub fn shell_join<S: AsRef<str>>(args: &[S]) -> String {
    args.iter()
        .map(|a| quote(a.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c));
    if plain {
        arg.to_owned()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_words_read_back_as_themselves() {
        let word = |s: &str| shell_path(std::path::Path::new(s));
        assert_eq!(word("/r/locks/images/a.lock"), "/r/locks/images/a.lock");
        assert_eq!(word("/r/a;rm -rf ~;.lock"), "'/r/a;rm -rf ~;.lock'");
        assert_eq!(word("it's"), r"'it'\''s'");
        assert_eq!(word("a\nb'c"), r"$'a\nb\'c'");
        assert_eq!(word("a\u{9b}\u{202e}"), r"$'a\xc2\x9b\xe2\x80\xae'");
        use std::os::unix::ffi::OsStrExt;
        let odd = std::path::Path::new(std::ffi::OsStr::from_bytes(b"/r/\xff\n"));
        assert_eq!(shell_path(odd), r"$'/r/\xff\n'");
        assert_eq!(word(""), "''");
        assert_eq!(
            shell_join(&["sh", "-c", "echo 'hi' there"]),
            r"sh -c 'echo '\''hi'\'' there'"
        );
        assert_eq!(
            shell_join(&["ch-image", "-t", "app", "."]),
            "ch-image -t app ."
        );
    }

    #[test]
    fn a_name_is_read_from_the_password_file_or_is_the_uid() {
        let text = "# comment\nroot:x:0:0:root:/root:/bin/sh\n+nis\nana:x:1000:1000::/home/ana:/bin/sh\nbad line\n";
        assert_eq!(name_in_passwd(text, 1000).as_deref(), Some("ana"));
        assert_eq!(name_in_passwd(text, 0).as_deref(), Some("root"));
        assert_eq!(name_in_passwd(text, 4242), None);
        assert!(!user_name_of(4_000_000_000).is_empty());
    }

    #[test]
    fn own_start_time_is_readable() {
        assert!(start_time(std::process::id()).is_some());
        assert!(start_time("self").is_some());
    }

    #[test]
    fn printable_escapes_what_drives_a_terminal() {
        assert_eq!(
            printable("ch-image build -t app ."),
            "ch-image build -t app ."
        );
        assert_eq!(
            printable("a\x1b[2J\nb\rc\u{202e}d\u{9b}"),
            r"a\x1b[2J\nb\rc\u{202e}d\x9b"
        );
        assert_eq!(printable("naïve"), "naïve");
        // A `$'…'` word to paste stays whole beside a raw newline.
        assert_eq!(printable("a\nb $'c\\nd'"), r"a\nb $'c\nd'");
    }
}

/// `stowage` as a hint names it: with `--root` as the user gave it, if they did, so that a command
/// run as the hint shows it acts on this root, not the default one.
pub struct Stowage;

pub static STOWAGE: Stowage = Stowage;

/// A fixed hint naming stowage commands ('stowage …'), said with [`STOWAGE`].
#[derive(Clone, Copy)]
pub struct Hint(pub &'static str);

impl std::fmt::Display for Hint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.replace("'stowage ", &format!("'{STOWAGE} ")))
    }
}

/// The `--root` given, quoted for a shell: set once, when the root is resolved.
static GIVEN_ROOT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Notes the `--root` the user gave, for [`STOWAGE`].
pub fn root_given(dir: &std::path::Path) {
    let _ = GIVEN_ROOT.set(shell_path(dir));
}

impl std::fmt::Display for Stowage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match GIVEN_ROOT.get() {
            // `--root=-r`: a root that starts with '-' would be read as an option after a blank.
            Some(root) if root.starts_with('-') => write!(f, "stowage --root={root}"),
            Some(root) => write!(f, "stowage --root {root}"),
            None => f.write_str("stowage"),
        }
    }
}
