//! What the store says about itself: `lock-status` (its JSON contract,
//! holders and waiters as the kernel shows them, never a lock held two ways at
//! once) and `images` (sizes, also of incomplete and unreadable trees, and
//! measurements that lose a race), the times they show, and records printed
//! safely.

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::common::*;

// --- lock-status ------------------------------------------------------------

fn is_rfc3339_utc(v: &Value) -> bool {
    let s = v.as_str().unwrap_or("");
    s.len() == 20 && s.ends_with('Z') && s.as_bytes()[10] == b'T'
}

#[test]
fn holder_and_waiter_with_every_field() {
    let env = Env::new();
    env.make_image("alpine:3.17");
    let holder = env.hold(&["--read", "alpine:3.17"], "started");
    let waiter = env.spawn(["exec", "--write", "alpine:3.17", "--", "true"]);
    env.wait_for_waiter("alpine:3.17");

    let st = env.status_json(Vec::<String>::new());
    assert_eq!(st["root"], env.root.display().to_string());
    assert!(st["filesystem"].as_str().is_some_and(|f| !f.is_empty()));
    let locks = st["locks"].as_array().unwrap();
    let global = locks
        .iter()
        .find(|l| l["kind"] == "global")
        .expect("global lock shown");
    assert_eq!(global["name"], "global");
    assert!(["free", "exclusive"].contains(&global["state"].as_str().unwrap()));
    let img = locks
        .iter()
        .find(|l| l["name"] == "alpine:3.17")
        .expect("held lock shown without asking");
    assert_eq!(img["kind"], "image");
    assert_eq!(img["image_state"], "ready");
    assert_eq!(img["state"], "shared");
    let uid = unsafe { libc::geteuid() };
    let user = passwd_name(uid)
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| uid.to_string());
    let host = our_hostname();

    let h = &img["holders"][0];
    assert_eq!(h["pid"], holder.pid());
    assert_eq!(h["host"], host);
    assert_eq!(h["user"], user);
    assert_eq!(h["mode"], "shared");
    assert!(h["command"].as_str().unwrap().starts_with("sh -c "), "{h}");
    assert!(is_rfc3339_utc(&h["since"]), "{h}");

    let w = &img["waiters"][0];
    assert_eq!(w["pid"], waiter.pid());
    assert_eq!(w["host"], host);
    assert_eq!(w["user"], user);
    assert_eq!(w["mode"], "exclusive");
    assert_eq!(w["command"], "true");
    assert!(is_rfc3339_utc(&w["since"]), "{w}");

    // The human form names the same.
    let out = env.ok(["lock-status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("alpine:3.17") && text.contains(&format!("pid {}", holder.pid())),
        "{text}"
    );

    env.release("release");
    assert_eq!(holder.finish().status.code(), Some(0));
    assert_eq!(waiter.finish().status.code(), Some(0));
    // Nothing is held now: only the global lock is listed.
    let st = env.status_json(Vec::<String>::new());
    assert_eq!(st["locks"].as_array().unwrap().len(), 1, "{st}");
}

/// The name of a uid in the password file, if it has one.
fn passwd_name(uid: u32) -> Option<String> {
    let text = fs::read_to_string("/etc/passwd").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 2 && f[2] == uid.to_string() && !f[0].starts_with(['#', '+', '-']))
            .then(|| f[0].to_owned())
    })
}

/// A holder and a waiter are named by their uid's name, whatever `$USER` says (`su` keeps it): two
/// processes of one uid are one user, as a flock(1) holder of that uid is shown.
#[test]
fn a_holders_user_is_its_uids_name_not_its_user_variable() {
    let env = Env::new();
    env.make_image("app");
    let posing = "somebody-else";
    let holder = env.hold_with(&["--read", "app"], "started", |c| {
        c.env("USER", posing);
    });
    let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
    c.env("USER", posing);
    let waiter = Bg::from_command(c);
    env.wait_for_waiter("app");
    let uid = unsafe { libc::geteuid() };
    // Without an entry, $USER is the best name there is.
    let want = passwd_name(uid).unwrap_or_else(|| posing.to_owned());
    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["holders"][0]["user"], want.as_str(), "{entry}");
    assert_eq!(entry["waiters"][0]["user"], want.as_str(), "{entry}");
    env.release("release");
    assert_eq!(code(&holder.finish()), Some(0));
    assert_eq!(code(&waiter.finish()), Some(0));
    // The same uid holding with flock(1) is the same user.
    let outsider = flock_holder(&env.lock_file("app"), &env.sentinel("flock"), "sleep 60");
    let entry = env.lock_entry("app").unwrap();
    if entry["holders"][0]["pid"] == outsider.pid() {
        assert_eq!(entry["holders"][0]["user"], want.as_str(), "{entry}");
    }
}

#[test]
fn a_lock_taken_with_flock_shows_as_held() {
    let env = Env::new();
    env.make_image("app");
    let started = env.sentinel("started");
    let outsider = flock_holder(&env.lock_file("app"), &started, "sleep 60");

    let entry = env.lock_entry("app").unwrap();
    assert_eq!(entry["state"], "exclusive", "{entry}");
    let h = &entry["holders"][0];
    assert_eq!(h["mode"], "exclusive");
    assert_eq!(h["stowage"], false, "{h}");
    // On a local filesystem the kernel's lock table names the process.
    if table_names_holders(&env) {
        assert_eq!(h["pid"], outsider.pid(), "{h}");
        assert!(h["command"].as_str().unwrap().contains("flock"), "{h}");
    }
    // It is listed without being named, too.
    let st = env.status_json(Vec::<String>::new());
    assert!(
        st["locks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["name"] == "app"),
        "{st}"
    );
    // And stowage respects it.
    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    assert!(
        stderr(&out).contains("not started by stowage"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn all_lists_every_image_and_names_select() {
    let env = Env::new();
    for n in ["a", "b", "c"] {
        env.make_image(n);
    }
    let names = |args: &[&str]| -> Vec<String> {
        env.status_json(args)["locks"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|l| l["name"].as_str().map(str::to_owned))
            .collect()
    };
    assert_eq!(names(&["--all"]), ["global", "a", "b", "c"]);
    assert_eq!(names(&["b"]), ["global", "b"]);
}

/// A removal's emptied lock file, kept where lock files are never unlinked
/// (here NFS, by the hidden hook), names no image: `lock-status --all`
/// lists the images there are, not the ones removed, in JSON and in text.
#[test]
fn lock_status_all_lists_no_image_removed_where_lock_files_are_kept() {
    let env = Env::new();
    let nfs = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
        let out = output(c);
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        out
    };
    env.make_image("kept");
    for n in ["gone1", "gone2"] {
        nfs(&["exec", "--write", n, "--", "true"]);
        nfs(&["rm", n]);
        assert!(env.lock_file(n).exists(), "{n}'s lock file is kept");
    }
    let out = nfs(&["lock-status", "--all", "--json"]);
    let st: Value = serde_json::from_slice(&out.stdout).unwrap();
    let locks = st["locks"].as_array().unwrap().iter();
    let names: Vec<&str> = locks.filter_map(|l| l["name"].as_str()).collect();
    assert_eq!(names, ["global", "kept"]);
    let text = stdout(&nfs(&["lock-status", "--all"]));
    assert!(text.contains("kept") && !text.contains("gone"), "{text}");
    // Named, one still says it does not exist.
    let mut c = env.cmd(["lock-status", "gone1"]);
    c.env(stowage::env::DEBUG_FILESYSTEM, "nfs");
    assert_eq!(code(&output(c)), Some(66));
}

/// A writer may finish between a listing's read of its record (`writing`)
/// and its look at the lock (then free): the record is read again, so
/// `images` and `lock-status` show the image ready, never incomplete.
#[test]
fn an_image_whose_writer_finishes_while_it_is_listed_is_never_shown_incomplete() {
    let env = Env::new();
    env.make_image("y");
    let listings: [&[&str]; 2] = [&["images", "--json"], &["lock-status", "--all", "--json"]];
    for (i, args) in listings.iter().enumerate() {
        let (started, release) = (format!("started{i}"), format!("release{i}"));
        let writer = env.hold_until(&["--write", "y"], &started, &release);
        let (lister, go_on) = env.paused(*args, "census-record-read");
        fs::write(env.sentinel(&release), "").unwrap();
        assert_eq!(code(&writer.finish()), Some(0));
        fs::remove_file(&go_on).unwrap();
        let out = lister.finish();
        assert_eq!(code(&out), Some(0), "{}", show(&out));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let state = match i {
            0 => v
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == "y")
                .unwrap()["state"]
                .clone(),
            _ => (v["locks"].as_array().unwrap().iter())
                .find(|l| l["name"] == "y")
                .unwrap()["image_state"]
                .clone(),
        };
        assert_eq!(state, "ready", "{}", show(&out));
    }
}

/// A writer may begin after lock-status read the kernel's lock table and
/// before it read the writer's record: the lock is looked at again, so the
/// image shows as being written, never as a dead writer's `incomplete`.
#[test]
fn an_image_whose_writer_begins_while_it_is_listed_is_never_shown_incomplete() {
    let env = Env::new();
    env.make_image("y");
    let (lister, go_on) = env.paused(["lock-status", "--all", "--json"], "status-table-read");
    let writer = env.hold(&["--write", "y"], "started");
    fs::remove_file(&go_on).unwrap();
    let out = lister.finish();
    writer.kill_all();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let y = (v["locks"].as_array().unwrap().iter())
        .find(|l| l["name"] == "y")
        .unwrap()
        .clone();
    assert_eq!(y["image_state"], "writing", "{y}");
    assert_eq!(y["state"], "exclusive", "{y}");
}

/// An interval of 0 or less is refused (64) in the same words, which say
/// what is accepted.
#[test]
fn a_watch_interval_must_be_above_zero() {
    let env = Env::new();
    for bad in ["0", "-1", "0ms"] {
        let out = env.run(["lock-status", "--watch", bad]);
        assert_eq!(code(&out), Some(64), "{bad}: {}", show(&out));
        let err = stderr(&out);
        assert!(
            err.contains("above 0") && !err.contains("0 or more"),
            "{err}"
        );
    }
}

#[test]
fn watch_prints_repeatedly() {
    use std::io::BufRead;
    let env = Env::new();
    env.make_image("a");
    let mut c = env.cmd(["lock-status", "--json", "--watch", "0.05"]);
    c.stdout(std::process::Stdio::piped());
    let mut bg = Bg::from_command(c);
    let stdout = bg.child.as_mut().unwrap().stdout.take().unwrap();
    // Read three snapshots (bounded by the harness), then stop it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().take(3) {
            let _ = tx.send(line.unwrap());
        }
    });
    let docs: Vec<Value> = (0..3)
        .map(|_| serde_json::from_str(&rx.recv_timeout(PATIENCE).expect("a snapshot")).unwrap())
        .collect();
    assert!(docs.iter().all(|d| d["locks"].is_array()));
    bg.signal(libc::SIGTERM);
    bg.finish();
}

/// An image whose newest record a later release wrote (slot B, its CRC
/// whole) beside this release's older one: no state of this release's is
/// true of it, so lock-status shows it unknown, never the older slot's.
#[test]
fn an_image_a_newer_stowage_recorded_shows_no_state_of_this_release() {
    let env = Env::new();
    env.make_image("base");
    let lock = env.lock_file("base");
    let mut bytes = fs::read(&lock).unwrap();
    let body = "stowage-record 2\nseq=99\nstate=deleting\nimage=base\nlater=1\n";
    let record = format!("{body}crc={:08x}\n", token_crc(body.as_bytes()));
    bytes.resize(8192, 0);
    bytes[4096..].fill(0);
    bytes[4096..4096 + record.len()].copy_from_slice(record.as_bytes());
    fs::write(&lock, &bytes).unwrap();
    let out = env.ok(["lock-status", "base"]);
    let row = stdout(&out)
        .lines()
        .find(|l| l.starts_with("base "))
        .map(str::to_owned);
    let row = row.unwrap_or_default();
    assert!(
        row.contains("(unknown)") && !row.contains("ready"),
        "{}",
        show(&out)
    );
    assert!(stderr(&out).contains("later format (2)"), "{}", show(&out));
    let out = env.ok(["lock-status", "--json", "base"]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let locks = doc["locks"].as_array().unwrap();
    let base = locks.iter().find(|l| l["name"] == "base").unwrap();
    assert!(base["image_state"].is_null(), "{doc}");
}

/// An image whose lock file was replaced by a directory or a FIFO (its
/// tree still there) is shown with its state unknown by lock-status, named
/// or with --all, and by images, as gc keeps it: never "does not exist".
#[test]
fn an_image_whose_lock_file_is_no_regular_file_is_shown_unknown() {
    for planted in ["directory", "fifo"] {
        let env = Env::new();
        env.make_image("base");
        env.make_image("app");
        let lock = env.lock_file("app");
        fs::remove_file(&lock).unwrap();
        match planted {
            "directory" => fs::create_dir(&lock).unwrap(),
            _ => {
                nix::unistd::mkfifo(&lock, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap()
            }
        }
        let out = env.run(["lock-status", "app"]);
        assert_eq!(code(&out), Some(0), "{planted}: {}", show(&out));
        assert!(
            stdout(&out).contains("(unknown)"),
            "{planted}: {}",
            show(&out)
        );
        assert!(
            stderr(&out).contains("not a regular file"),
            "{planted}: {}",
            show(&out)
        );
        let out = env.ok(["lock-status", "--all", "--json"]);
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
        let locks = doc["locks"].as_array().unwrap();
        let app = locks.iter().find(|l| l["name"] == "app");
        assert!(
            app.is_some_and(|a| a["image_state"].is_null()),
            "{planted}: {doc}"
        );
        let json = env.images_json();
        assert!(
            json.iter().any(|i| i["name"] == "app"),
            "{planted}: {json:?}"
        );
        let out = env.ok(["gc", "--dry-run"]);
        assert!(
            stdout(&out).contains("kept 'app'"),
            "{planted}: {}",
            show(&out)
        );
        env.ok(["doctor", "--repair"]);
        assert!(env.images_json().iter().any(|i| i["name"] == "app"));
    }
}

#[test]
fn lock_status_of_an_image_that_does_not_exist_says_so() {
    let env = Env::new();
    env.make_image("base");
    let out = env.run(["lock-status", "nosuch", "base"]);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("image 'nosuch' does not exist"),
        "{}",
        show(&out)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("base") && !text.contains("nosuch"), "{text}");
    env.ok(["lock-status", "base"]);
}

#[test]
fn lock_status_never_shows_a_lock_held_two_ways_at_once() {
    let env = Env::new();
    env.make_image("app");
    // Many short transactions: the global lock changes hands constantly.
    let stop = env.sentinel("stop");
    let churn: Vec<Bg> = (0..3)
        .map(|_| {
            let script = format!(
                "i=0; while [ ! -e '{s}' ] && [ $i -lt 3000 ]; do '{b}' --root '{r}' exec --read app -- true; i=$((i+1)); done",
                s = stop.display(),
                b = bin(),
                r = env.root.display()
            );
            let mut c = Command::new("sh");
            c.args(["-c", &script]);
            Bg::from_command(c)
        })
        .collect();
    let mut held_twice = Vec::new();
    for _ in 0..300 {
        let st = env.status_json(["app"]);
        for l in st["locks"].as_array().unwrap() {
            let holders = l["holders"].as_array().unwrap();
            let exclusive = holders.iter().filter(|h| h["mode"] == "exclusive").count();
            if exclusive > 1 || (exclusive == 1 && holders.len() > 1) {
                held_twice.push(l.clone());
            }
        }
    }
    fs::write(&stop, "").unwrap();
    for c in churn {
        let out = c.finish();
        assert!(out.status.success(), "{}", show(&out));
    }
    assert!(held_twice.is_empty(), "{held_twice:#?}");
}

/// A waiter granted a lock (an image's, a slot, the store-wide lock) still
/// lists it as awaited in its lease until it rewrites the lease: paused
/// there, lock-status lists it once, as the holder, never also as a waiter;
/// `--why` does not say it waits for what it holds. Before, it was listed
/// both ways (2–8 % of looks at a queue of writers).
#[test]
fn a_waiter_granted_the_lock_is_listed_once_as_its_holder() {
    let env = Env::new();
    env.make_image("x");
    env.ok(["slots", "set", "pull", "1"]);
    let cases: [(&[&str], &str, &str); 3] = [
        (&["--write", "x"], "image", "x"),
        (&["--slot", "pull"], "slot", "pull"),
        (&["--store-wide"], "global", "store"),
    ];
    for (locks, kind, name) in cases {
        let holder = env.hold(locks, "held");
        let pause = env.sentinel("paused.lock-granted");
        let mut args = vec!["exec"];
        args.extend(locks);
        args.extend(["--", "true"]);
        let mut c = env.cmd(args);
        c.env(
            stowage::env::DEBUG_PAUSE,
            format!("lock-granted:{}", pause.display()),
        );
        let waiter = Bg::from_command(c);
        let pid = waiter.pid();
        env.wait_for_waiting_pid(pid, name);
        env.release("release");
        assert!(holder.finish().status.success());
        wait_for_file(&pause);
        let st = env.status_json(Vec::<&str>::new());
        let why = env.ok(["lock-status", "--why", &pid.to_string()]);
        fs::remove_file(&pause).unwrap();
        assert!(waiter.finish().status.success());
        fs::remove_file(env.sentinel("held")).unwrap();
        fs::remove_file(env.sentinel("release")).unwrap();
        let lock = (st["locks"].as_array().unwrap().iter())
            .find(|l| l["kind"] == kind && l["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} lock {name}: {st}"));
        let listed = |what: &str| {
            let parties = lock[what].as_array().unwrap();
            parties.iter().filter(|p| p["pid"] == pid).count()
        };
        assert_eq!((listed("holders"), listed("waiters")), (1, 0), "{lock}");
        // Named by the line that awaited the lock: for the command it runs.
        assert_eq!(lock["holders"][0]["command"], "true", "{lock}");
        let said = stdout(&why);
        assert!(
            said.starts_with(&format!("pid {pid} waits for no lock")),
            "{said}"
        );
    }
}

// --- printed records --------------------------------------------------------

#[test]
fn control_characters_of_a_recorded_command_are_escaped_when_printed() {
    let env = Env::new();
    env.make_image("app");
    // The holder's command carries a screen-clearing escape and a newline
    // that would forge a second table row.
    // A C1 CSI and a right-to-left override drive or reorder a terminal too.
    let evil = "\u{1b}[2J\u{1b}]0;pwned\u{7}\u{9b}2J\u{202e}\nglobal  global  free  forged";
    let mut args: Vec<String> = ["exec", "--write", "app", "--"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(env.hold_cmd("started", "release"));
    args.push(evil.into());
    let _h = env.spawn(&args);
    wait_for_file(&env.sentinel("started"));

    let out = env.ok(["lock-status"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let raw = |t: &str| {
        t.chars()
            .any(|c| c != '\n' && (c.is_control() || c == '\u{202e}'))
    };
    assert!(!raw(&text), "{text:?}");
    assert!(!text.contains("\nglobal  global  free  forged"), "{text}");
    assert!(text.contains(r"\x1b[2J"), "{text}");

    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let err = stderr(&out);
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");

    // JSON keeps the exact command, every such character escaped.
    let json = stdout(&env.ok(["lock-status", "--json", "app"]));
    assert!(!raw(&json), "{json:?}");
    assert!(json.contains(r"\u009b2J\u202e"), "{json}");
    let st: serde_json::Value = serde_json::from_str(&json).unwrap();
    let holder = &st["locks"].as_array().unwrap().last().unwrap()["holders"][0];
    let command = holder["command"].as_str().unwrap();
    assert!(
        command.contains("\u{1b}[2J\u{1b}]0;pwned\u{7}\u{9b}2J\u{202e}"),
        "{st}"
    );
    env.release("release");
}

/// A watch has no end of its own: its reader going (`| head`) ends it,
/// quietly, as SIGPIPE would: exit 141, nothing on stderr.
#[test]
fn a_watch_ends_quietly_when_its_reader_goes() {
    let env = Env::new();
    env.make_image("app");
    let mut c = env.cmd(["lock-status", "--watch", "0.05"]);
    c.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut watch = Bg::from_command(c);
    let child = watch.child.as_mut().unwrap();
    let mut first = [0u8; 4];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first).unwrap();
    drop(child.stdout.take());
    let out = watch.finish();
    assert_eq!(code(&out), Some(141), "{}", show(&out));
    assert_eq!(stderr(&out), "");
}

// --- times ------------------------------------------------------------------

#[test]
fn a_clock_in_milliseconds_or_bogus_is_refused_and_creates_nothing() {
    let env = Env::new();
    for bad in ["1795953784000", "bogus", "-3"] {
        let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
        c.env("STOWAGE_NOW", bad);
        let out = output(c);
        assert_eq!(out.status.code(), Some(64), "{bad}: {}", show(&out));
        let err = stderr(&out);
        assert!(err.contains("STOWAGE_NOW"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!env.root.exists(), "{bad}: the store was created");
    }
    let mut c = env.cmd(["exec", "--write", "app", "--", "true"]);
    c.env("STOWAGE_NOW", "1795953784");
    let out = output(c);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}

/// RFC 3339 allows any offset and either case: each names the same instant,
/// recorded in UTC (only "Z" and "+00:00" were read; the rest exited 64).
#[test]
fn a_clock_given_with_an_offset_is_the_same_instant() {
    let env = Env::new();
    for (n, now) in ["2026-11-29T07:03:04-05:00", "2026-11-30t02:03:04+14:00"]
        .iter()
        .enumerate()
    {
        let img = format!("app{n}");
        let mut c = env.cmd(["exec", "--write", &img, "--", "true"]);
        c.env("STOWAGE_NOW", now);
        let out = output(c);
        assert_eq!(out.status.code(), Some(0), "{now}: {}", show(&out));
        assert_eq!(env.image(&img).unwrap()["created"], "2026-11-29T12:03:04Z");
    }
}

/// Rewrites an image's record with its creation and last use at the given
/// times, as another host's clock may have written them.
fn set_stored_times(env: &Env, image: &str, created: i64, used: i64) {
    use stowage::image_record;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(env.lock_file(image))
        .unwrap();
    let mut seen = image_record::read(&f).unwrap();
    let mut r = seen.record.clone().unwrap();
    (r.created, r.changed) = (created, created);
    image_record::write(&f, &mut seen, &r).unwrap();
    image_record::set_last_use(&f, used).unwrap();
}

#[test]
fn a_stored_time_past_year_9999_is_shown_as_unknown_not_a_panic() {
    let env = Env::new();
    env.make_image("app");
    set_stored_times(&env, "app", i64::MAX, 1_795_953_784_000_000);
    let img = env.image("app").unwrap();
    assert!(img["created"].is_null(), "{img}");
    // A use recorded past the lock file's last write is a clock ahead: shown
    // as that write's time (within the resolution), a time RFC 3339 can say.
    assert!(img["last_used"].is_string(), "{img}");
    let out = env.ok(["images"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("unknown"));
    env.status_json(["--all"]);
    env.ok(["lock-status", "--all"]);
    env.ok(["gc", "--unused-for", "1d", "--dry-run"]);
    // A holder whose lease says it started after year 9999.
    let _h = env.hold(&["--read-exclusive", "app"], "started");
    for lease in fs::read_dir(env.root.join("locks/leases"))
        .unwrap()
        .flatten()
    {
        let text = fs::read_to_string(lease.path()).unwrap();
        let far = text
            .lines()
            .map(|l| match l.strip_prefix("hold=") {
                Some(h) => {
                    let mut f: Vec<&str> = h.splitn(4, ' ').collect();
                    let max = i64::MAX.to_string();
                    f[2] = &max;
                    format!("hold={}", f.join(" "))
                }
                None => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        fs::write(lease.path(), far + "\n").unwrap();
    }
    let st = env.status_json(["app"]);
    let entry = st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "app")
        .unwrap()
        .clone();
    assert!(entry["holders"][0]["since"].is_null(), "{entry}");
    env.ok(["lock-status"]);
    env.release("release");
}

// --- sizes ------------------------------------------------------------------

#[test]
fn an_incomplete_image_has_a_size() {
    let env = Env::new();
    let writer = env.start_sh(&["--write", "half"], |started| {
        format!(
            "head -c 262144 /dev/urandom > \"$STOWAGE_IMAGE_DIR/part\"; touch '{}'; sleep 60",
            started.display()
        )
    });
    writer.kill_all();
    let img = env.image("half").unwrap();
    assert_eq!(img["state"], "incomplete", "{img}");
    assert!(
        img["size_bytes"].as_u64().is_some_and(|s| s >= 262_144),
        "{img}"
    );
    let table = String::from_utf8_lossy(&env.ok(["images"]).stdout).into_owned();
    let row = table.lines().find(|l| l.starts_with("half")).unwrap();
    assert!(!row.contains(" ? "), "{row}");
}

#[test]
fn an_image_with_a_directory_one_may_not_read_still_has_a_size() {
    let env = unprivileged_env();
    // Not readable nor searchable; listable, not searchable; searchable, not listable.
    let modes = ["000", "600", "100"];
    for mode in modes {
        let script = format!(
            "cd \"$STOWAGE_IMAGE_DIR\" && head -c 300000 /dev/urandom > data && mkdir locked && echo x > locked/f && chmod {mode} locked"
        );
        unprivileged_build(&env, &format!("mode{mode}"), &script);
    }
    let out = unprivileged(&env, &["images", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for row in rows.as_array().unwrap() {
        let size = row["size_bytes"].as_u64();
        assert!(size.is_some_and(|s| s >= 300_000), "{row}: {}", show(&out));
    }
    // So gc's budget sees them.
    let out = unprivileged(&env, &["gc", "--max-size", "100K", "--dry-run", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["removed"].as_array().map(Vec::len),
        Some(modes.len()),
        "{}",
        show(&out)
    );
}

/// How both measuring races end: IMAGE has recorded its real size (at
/// least 1 MiB); the measurer paused at `go_on` with the older, smaller
/// measurement goes on, must succeed, and must leave the real size as it
/// was.
fn late_measurement_keeps_the_real_size(env: &Env, image: &str, late: Bg, go_on: PathBuf) {
    let real = env.image(image).unwrap()["size_bytes"].as_u64().unwrap();
    assert!(real >= MIB);
    fs::remove_file(go_on).unwrap();
    let out = late.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.image(image).unwrap()["size_bytes"].as_u64(), Some(real));
}

#[test]
fn gc_does_not_overwrite_a_finished_writers_size() {
    let env = Env::new();
    // A writer at work on a new image (its size unknown until it ends).
    let writer = env.start_sh(&["--write", "new"], |started| {
        format!(
            "touch '{s}'; i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done; \
             head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
            s = started.display(),
            r = env.sentinel("release").display()
        )
    });
    // gc measures the image while it is still empty, and stops there.
    let (gc, go_on) = env.paused(["gc"], "sizes-measured");
    // The writer finishes and records its real size.
    env.release("release");
    let out = writer.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    // gc goes on: its stale measurement must not replace the real size.
    late_measurement_keeps_the_real_size(&env, "new", gc, go_on);
}

#[test]
fn images_does_not_overwrite_a_rewriters_size() {
    let env = Env::new();
    env.make_image("app");
    // `images` measures the small image, and stops before recording it.
    let (lister, go_on) = env.paused(["images", "--json"], "sizes-measured");
    env.build(
        "app",
        "head -c 1048576 /dev/urandom > \"$STOWAGE_IMAGE_DIR/blob\"",
    );
    late_measurement_keeps_the_real_size(&env, "app", lister, go_on);
}

// --- lock-status while nothing is held (idle.rs) ----------------------------

/// `lock-status` and `lock-status --json` on `env`, with `fs` as the
/// filesystem's name if given (the hidden hook), and whether either took
/// the database's way: a transaction (SQLite's `fcntl` locks on
/// stowage.db) under the global lock, seen by strace; `None` where strace
/// cannot run here.
fn look(env: &Env, fs: Option<&str>) -> (String, Value, Option<bool>) {
    let (text, json, calls) = look_traced(env, fs);
    let took = calls.map(|c| used_database(&c));
    (text, json, took)
}

/// Whether these calls lock the database (SQLite's `fcntl` locks: a
/// transaction, which stowage opens only under the global lock).
fn used_database(calls: &str) -> bool {
    calls
        .lines()
        .any(|l| l.starts_with("fcntl") && l.contains("stowage.db>") && l.contains("SETLK"))
}

/// [`look`], with the `flock` and `fcntl` calls of both runs as strace
/// shows them (pid column dropped), if it can run here.
fn look_traced(env: &Env, fs: Option<&str>) -> (String, Value, Option<String>) {
    let traced = have("strace");
    let mut calls = String::new();
    let mut run = |json: bool| {
        let log = env.scratch.join("idle-strace.log");
        let mut c = if traced {
            let mut c = Command::new("strace");
            c.args(["-f", "-y", "-e", "trace=flock,fcntl", "-o"])
                .arg(&log)
                .arg(bin());
            c
        } else {
            Command::new(bin())
        };
        c.arg("--root").arg(&env.root).arg("lock-status");
        if json {
            c.arg("--json");
        }
        c.env_remove("STOWAGE_ROOT").env_remove("STOWAGE_NOW");
        if let Some(fs) = fs {
            c.env(stowage::env::DEBUG_FILESYSTEM, fs);
        }
        let out = wait_output(
            c.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
            std::time::Duration::from_secs(60),
        );
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        if traced {
            for l in fs::read_to_string(&log).unwrap().lines() {
                let call = l.split_once(' ').map_or(l, |(_, c)| c.trim_start());
                calls.push_str(call);
                calls.push('\n');
            }
        }
        String::from_utf8(out.stdout).unwrap()
    };
    let text = run(false);
    let json = serde_json::from_str(&run(true)).unwrap();
    (text, json, traced.then_some(calls))
}

/// lock-status on `env`: it answers without the catalog or the global lock,
/// and a lock elsewhere on the filesystem, or a file of the root that is
/// no lock of stowage's held by flock(1), changes nothing it shows.
fn idle_equals_database_view(env: &Env, fs: Option<&str>, what: &str) {
    let (text, json, took) = look(env, fs);
    assert_ne!(took, Some(true), "{what}: took the catalog");
    let started = env.sentinel(&format!("elsewhere-{}", what.replace(' ', "-")));
    let elsewhere = flock_holder(&env.scratch.join("elsewhere.lock"), &started, "sleep 60");
    let started = env.sentinel(&format!("unrelated-{}", what.replace(' ', "-")));
    let unrelated = flock_holder(&env.root.join("unrelated.lock"), &started, "sleep 60");
    let (t, j, took) = look(env, fs);
    elsewhere.kill_all();
    unrelated.kill_all();
    assert_ne!(took, Some(true), "{what}: took the catalog");
    assert_eq!((&t, &j), (&text, &json), "{what}");
}

fn slot_row(st: &Value, class: &str) -> Value {
    st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "slot" && l["name"] == class)
        .cloned()
        .unwrap_or_else(|| panic!("no row for class {class}: {st}"))
}

#[test]
fn idle_lock_status_shows_what_the_database_view_shows() {
    for fs in [None, Some("nfs")] {
        let env = Env::new();
        env.make_image("base");
        env.ok(["exec", "--read", "base", "--", "true"]);
        idle_equals_database_view(&env, fs, "no class");
        env.ok(["slots", "set", "pull", "2"]);
        idle_equals_database_view(&env, fs, "one class");
        env.ok(["slots", "set", "load/podman", "3", "--reserve-high", "1"]);
        idle_equals_database_view(&env, fs, "nested class with reserve");
        env.ok(["slots", "set", "any", "0"]);
        idle_equals_database_view(&env, fs, "unlimited class");
        let (_, st, _) = look(&env, fs);
        let podman = slot_row(&st, "load/podman");
        assert_eq!(
            (&podman["limit"], &podman["reserve_high"], &podman["in_use"]),
            (&Value::from(3), &Value::from(1), &Value::from(0)),
            "{st}"
        );
        assert_eq!(slot_row(&st, "any")["limit"], 0, "{st}");
        assert_eq!(st["locks"][0]["name"], "global", "{st}");
        assert_eq!(st["locks"].as_array().unwrap().len(), 4, "{st}");
    }
}

#[test]
fn a_lowered_limit_a_lost_class_record_and_a_stray_directory_are_shown_as_they_are() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["slots", "set", "pull", "2"]);
    // Two slots held, then the limit lowered: the records are written
    // unsettled (1.lock, beyond the new limit, is held), and stay so once
    // both holders are gone.
    let a = env.hold_until(&["--slot", "pull", "--read", "base"], "a", "release-a");
    let b = env.hold_until(&["--slot", "pull", "--read", "base"], "b", "release-b");
    env.ok(["slots", "set", "pull", "1"]);
    env.release("release-a");
    env.release("release-b");
    a.finish();
    b.finish();
    let (text, st, took) = look(&env, None);
    assert_ne!(took, Some(true), "unsettled records: answered idle");
    assert_eq!(slot_row(&st, "pull")["limit"], 1, "{st}");
    assert_eq!(slot_row(&st, "pull")["in_use"], 0, "{st}");
    assert!(text.contains("pull"), "{text}");
    // Set again with nothing held: settled, and answered idle.
    env.ok(["slots", "set", "pull", "2"]);
    let (_, st, took) = look(&env, None);
    assert_ne!(took, Some(true), "settled records: took the global lock");
    assert_eq!(slot_row(&st, "pull")["limit"], 2, "{st}");
    // The class record gone (its file emptied): the class is gone, as
    // its record is its one home; setting it again brings it back.
    fs::File::create(env.root.join("locks/slots/pull/0.lock")).unwrap();
    let (text, _, took) = look(&env, None);
    assert_ne!(took, Some(true), "no record: took the catalog");
    assert!(!text.contains("pull"), "{text}");
    // Written again; then a class directory that is no class's: doubt,
    // and not shown.
    env.ok(["slots", "set", "pull", "2"]);
    let (idle_text, idle_st, took) = look(&env, None);
    assert_ne!(took, Some(true), "settled records: took the global lock");
    fs::create_dir_all(env.root.join("locks/slots/gone/x")).unwrap();
    let (text, st, took) = look(&env, None);
    assert_ne!(took, Some(true), "a stray directory: answered idle");
    assert_eq!((text, st), (idle_text, idle_st));
}

#[test]
fn idle_lock_status_does_not_take_the_global_lock_and_shows_who_holds_it() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["slots", "set", "pull", "2"]);
    for fs in [None, Some("nfs")] {
        let _ = fs::remove_file(env.sentinel("global-held"));
        let outsider = hold_global(&env);
        // It answers while flock(1) holds the global lock: it did not wait
        // for it (look's bounded wait fails the test otherwise). Where the
        // lock table tells, it does not even try it (on NFS a probe does).
        let (text, st, calls) = look_traced(&env, fs);
        if let Some(calls) = calls {
            assert!(!used_database(&calls), "{fs:?}: {calls}");
            if fs.is_none() {
                assert!(!calls.contains("global.lock>"), "{calls}");
            }
        }
        let g = &st["locks"][0];
        assert_eq!(
            (&g["name"], &g["state"]),
            (&"global".into(), &"exclusive".into()),
            "{st}"
        );
        if fs.is_none() {
            // The lock table names it.
            assert_eq!(g["holders"][0]["pid"], outsider.pid(), "{st}");
            assert_eq!(g["holders"][0]["stowage"], false, "{st}");
            assert!(text.contains("[outside stowage]"), "{text}");
        }
        assert_eq!(slot_row(&st, "pull")["limit"], 2, "{st}");
        outsider.kill_all();
    }
    // Something held (a stowage reader): still no wait for the global
    // lock, and the reader is shown.
    let reader = env.hold(&["--read", "base"], "reader");
    let _ = fs::remove_file(env.sentinel("global-held"));
    let outsider = hold_global(&env);
    let (_, st, _) = look_traced(&env, None);
    outsider.kill_all();
    let base = st["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "base")
        .cloned()
        .unwrap_or_else(|| panic!("the reader is not shown: {st}"));
    assert_eq!(base["state"], "shared", "{st}");
    assert_eq!(base["holders"][0]["stowage"], true, "{st}");
    env.release("release");
    reader.finish();
}

#[test]
fn outsiders_on_an_image_lock_or_a_slot_file_are_shown() {
    for fs in [None, Some("nfs")] {
        let env = Env::new();
        env.make_image("base");
        env.ok(["exec", "--read", "base", "--", "true"]);
        env.ok(["slots", "set", "pull", "2"]);
        let o = flock_holder(&env.lock_file("base"), &env.sentinel("image"), "sleep 60");
        if fs == Some("nfs") {
            // Without a lock table neither way can see it (only an image
            // asked for by name is probed): both say the same.
            idle_equals_database_view(&env, fs, "image held on nfs");
        } else {
            let (_, st, took) = look(&env, fs);
            assert_ne!(took, Some(true), "{fs:?}: an image held, answered idle");
            let base = st["locks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["name"] == "base")
                .cloned()
                .unwrap_or_else(|| panic!("flock(1) on the image lock not shown: {st}"));
            assert_eq!(base["state"], "exclusive", "{st}");
            assert_eq!(base["holders"][0]["pid"], o.pid(), "{st}");
        }
        o.kill_all();
        let slot = env.root.join("locks/slots/pull/0.lock");
        let o = flock_holder(&slot, &env.sentinel("slot"), "sleep 60");
        let (_, st, took) = look(&env, fs);
        assert_ne!(took, Some(true), "{fs:?}: a slot held, answered idle");
        let pull = slot_row(&st, "pull");
        assert_eq!(pull["in_use"], 1, "{fs:?}: {st}");
        if fs.is_none() {
            assert_eq!(pull["holders"][0]["stowage"], false, "{st}");
            assert_eq!(pull["holders"][0]["pid"], o.pid(), "{st}");
        } else {
            // No table: a holder nothing names may be another host's stowage.
            assert_eq!(pull["holders"][0]["stowage"], Value::Null, "{st}");
        }
        o.kill_all();
    }
}

#[test]
fn a_class_removed_while_held_leaves_nothing_once_its_holder_is_gone() {
    let env = Env::new();
    env.make_image("base");
    env.ok(["exec", "--read", "base", "--", "true"]);
    env.ok(["slots", "set", "pull", "1"]);
    env.ok(["slots", "set", "gone", "1"]);
    let holder = env.hold(&["--slot", "gone", "--read", "base"], "holding");
    env.ok(["slots", "rm", "gone"]);
    env.release("release");
    holder.finish();
    // Its held file outlived the removal: no class behind the directory,
    // so the database's way, which takes the leftovers away...
    assert!(env.root.join("locks/slots/gone").exists());
    let (text, st, took) = look(&env, None);
    assert_ne!(
        took,
        Some(true),
        "a removed class's directory: answered idle"
    );
    assert!(!text.contains("gone"), "{text}");
    assert!(!env.root.join("locks/slots/gone").exists());
    // ...and the next look is idle again, with the same answer.
    let (idle_text, idle_st, took) = look(&env, None);
    assert_ne!(took, Some(true), "took the global lock idle");
    assert_eq!((idle_text, idle_st), (text, st));
}

// --- images being written, and images seen from inside -------------------------

#[test]
fn an_image_being_written_shows_as_writing_and_its_lock_exclusive() {
    let env = Env::new();
    env.make_image("base");
    let writer = env.hold(&["--write", "base"], "started");
    assert_eq!(env.state("base").as_deref(), Some("writing"));
    let entry = env.lock_entry("base").unwrap();
    assert_eq!(entry["image_state"], "writing", "{entry}");
    assert_eq!(entry["state"], "exclusive", "{entry}");
    let out = env.run(["exec", "--read", "base", "--no-wait", "--", "true"]);
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    // A look changes nothing while the writer holds its lock.
    assert_eq!(env.state("base").as_deref(), Some("writing"));
    env.release("release");
    assert_eq!(code(&writer.finish()), Some(0));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
}

/// `images` inside the writer's own command shows its image being
/// written; once the write ends, it is ready.
#[test]
fn images_inside_a_writers_command_shows_its_image_being_written() {
    let env = Env::new();
    env.make_image("base");
    let seen = env.sentinel("seen");
    let script = format!(
        "echo new > \"$STOWAGE_IMAGE_DIR/file\"; '{bin}' --root '{root}' images --json > '{seen}'",
        bin = bin(),
        root = env.root.display(),
        seen = seen.display()
    );
    env.build("base", &script);
    let inner: Value = serde_json::from_slice(&fs::read(&seen).unwrap()).unwrap();
    let row = inner
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "base")
        .unwrap()
        .clone();
    assert_eq!(row["state"], "writing", "{row}");
    assert_eq!(row["in_use"], true, "{row}");
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    assert_eq!(env.read_in_image("base", "file"), "new\n");
}

/// Writes of an existing and of a new image while an outside program
/// holds the global lock: neither waits for it, and once it is free
/// `images` shows what each write made, sized.
#[test]
fn writes_made_while_the_global_lock_was_held_are_shown_sized() {
    let env = Env::new();
    env.make_image("base");
    let before = env.image("base").unwrap();
    let global = hold_global(&env);
    for (name, bytes) in [("base", 200_000), ("app", 100_000)] {
        let out = env.run([
            "exec",
            "--write",
            name,
            "--wait",
            "0.3",
            "--",
            "sh",
            "-c",
            &format!("head -c {bytes} /dev/zero > \"$STOWAGE_IMAGE_DIR/big\""),
        ]);
        assert_eq!(code(&out), Some(0), "{name}: {}", show(&out));
    }
    let out = env.run(["exec", "--read", "app", "--wait", "0.3", "--", "true"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    global.kill_all();
    let base = env.image("base").unwrap();
    assert_eq!(base["state"], "ready", "{base}");
    assert!(
        base["size_bytes"].as_u64().unwrap() >= before["size_bytes"].as_u64().unwrap() + 200_000,
        "{before} → {base}"
    );
    let app = env.image("app").unwrap();
    assert_eq!(app["state"], "ready", "{app}");
    assert!(app["size_bytes"].as_u64().unwrap() >= 100_000, "{app}");
    assert!(app["base"].is_null(), "{app}");
    env.ok(["doctor"]);
}

/// On a filesystem with no space left, not even for the reserve: `images`
/// still shows each image's state, and does not count the locks it takes
/// to look as uses of them.
#[test]
fn images_on_a_full_filesystem_shows_the_states_and_no_use_of_its_own() {
    let Some(t) = Mount::tmpfs("size=8m,mode=0755") else {
        return;
    };
    let env = t.env();
    env.make_image("base");
    env.make_image("base");
    let _ = fs::remove_file(env.root.join("reserve"));
    let filler = t.dir.join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=4k", "status=none"])
        .arg(format!("of={}", filler.display()))
        .output();
    let out = env.ok(["images", "--json"]);
    let rows: Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "base")
        .unwrap();
    assert_eq!(row["state"], "ready", "{row}");
    assert_eq!(row["in_use"], false, "{row}");
    fs::remove_file(&filler).unwrap();
}

/// More images than the descriptors `images` may open (a limit of 100,
/// 150 images): every one is listed, ready and sized.
#[test]
fn images_lists_more_images_than_its_descriptor_limit() {
    let env = Env::new();
    let names: Vec<String> = (0..150).map(|i| format!("img{i:03}")).collect();
    for n in &names {
        env.build(n, "echo x > \"$STOWAGE_IMAGE_DIR/f\"");
    }
    let mut c = env.cmd(["images", "--json"]);
    // SAFETY: only setrlimit(2) between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 100,
                rlim_max: 100,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let rows: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 150);
    assert!(
        rows.iter()
            .all(|r| r["state"] == "ready" && r["size_bytes"].as_u64().unwrap() > 0),
        "{rows:?}"
    );
}

/// `images` lists by name as written ('app' before 'app-debug' and
/// 'app/sub'), not by lock file name, which put 'app/sub' ('app%sub') and
/// 'app-debug' before 'app'.
#[test]
fn images_are_listed_by_name() {
    let env = Env::new();
    for n in ["app_x", "app/sub", "app-debug", "app", "app.v2"] {
        env.make_image(n);
    }
    let names: Vec<String> = env
        .images_json()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["app", "app-debug", "app.v2", "app/sub", "app_x"]);
    let out = env.ok(["images"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let listed: Vec<&str> = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(listed, names);
}

/// Every image entry of `lock-status --json` has `image_state`, null for
/// a lock file that holds no record (taken with flock(1) before any
/// image of the name was made): a consumer may index it without a check.
#[test]
fn every_image_entry_has_an_image_state_null_where_no_record_says() {
    let env = Env::new();
    env.make_image("app");
    let started = env.sentinel("started");
    let lock = env.root.join("locks/images/alpine+3.17.lock");
    let _outsider = flock_holder(&lock, &started, "sleep 60");
    let st = env.status_json(["--all"]);
    let images: Vec<&Value> = (st["locks"].as_array().unwrap().iter())
        .filter(|l| l["kind"] == "image")
        .collect();
    assert_eq!(images.len(), 2, "{st}");
    for l in images {
        let state = l.get("image_state").unwrap_or_else(|| panic!("{l}"));
        let want = if l["name"] == "app" {
            "ready".into()
        } else {
            Value::Null
        };
        assert_eq!(*state, want, "{l}");
    }
}

/// A command's background child keeps the locks its exec took (the
/// default), after the exec has ended and its lease is gone: lock-status
/// and a busy reader name that child by its pid, not "a process stowage
/// cannot identify … or on another host".
#[test]
fn a_lock_kept_by_an_ended_execs_child_names_that_child() {
    let env = Env::new();
    let pidfile = env.sentinel("child");
    let script = format!(
        "sleep 60 >/dev/null 2>&1 & echo $! > '{}'",
        pidfile.display()
    );
    env.ok(["exec", "--write", "a", "--", "sh", "-c", &script]);
    let child: u32 = fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let entry = env.lock_entry("a").unwrap();
    let out = env.run(["exec", "--read", "a", "--no-wait", "--", "true"]);
    // SAFETY: a pid of our own child's child, which we end.
    unsafe { libc::kill(child as i32, libc::SIGKILL) };
    if !table_names_holders(&env) {
        eprintln!("skipping the pid check: this filesystem's lock table names no holder");
        return;
    }
    assert_eq!(entry["holders"][0]["pid"], child, "{entry}");
    assert_eq!(entry["holders"][0]["kept"], true, "{entry}");
    assert_eq!(code(&out), Some(75), "{}", show(&out));
    let said = format!("pid {child} ");
    assert!(stderr(&out).contains(&said), "{}", show(&out));
    assert!(
        stderr(&out).contains("after the exec that took it ended"),
        "{}",
        show(&out)
    );
}

/// Every child that kept a read lock after its exec ended is named, each
/// with `"kept": true`, beside a reader whose exec holds it now (its
/// command shares its descriptor and is named by its lease). Before, a
/// live reader made the kept ones "unknown … or on another host", and of
/// two kept children only one was named.
#[test]
fn every_child_that_kept_a_lock_is_named_beside_a_live_reader() {
    let env = Env::new();
    env.make_image("b");
    let pids = env.sentinel("kids");
    let script = format!(
        "sleep 60 >/dev/null 2>&1 & a=$!; sleep 61 >/dev/null 2>&1 & echo $a $! > '{}'",
        pids.display()
    );
    env.ok(["exec", "--read", "b", "--", "sh", "-c", &script]);
    let kids: Vec<u64> = (fs::read_to_string(&pids).unwrap().split_whitespace())
        .map(|p| p.parse().unwrap())
        .collect();
    let reader = env.hold(&["--read", "b"], "reading");
    let entry = env.lock_entry("b").unwrap();
    reader.kill_all();
    for &k in &kids {
        // SAFETY: pids of processes this test started.
        unsafe { libc::kill(k as i32, libc::SIGKILL) };
    }
    if !table_names_holders(&env) {
        eprintln!("skipping: this filesystem's lock table names no holder");
        return;
    }
    let holders = entry["holders"].as_array().unwrap();
    let kept: Vec<u64> = (holders.iter())
        .filter(|h| h["kept"] == true)
        .filter_map(|h| h["pid"].as_u64())
        .collect();
    assert_eq!(kept.len(), 2, "{entry}");
    assert!(kids.iter().all(|k| kept.contains(k)), "{entry}");
    assert!(holders.iter().any(|h| h["stowage"] == true), "{entry}");
    assert!(holders.iter().all(|h| !h["pid"].is_null()), "{entry}");
}

/// An exec SIGKILLed while its command runs: the command keeps the lock it
/// inherited, with the lease (alive: the command holds it) or having
/// closed the lease (dead). lock-status and a busy reader name the command
/// by its pid, as kept, for the command and time the lease gives. Before,
/// its pid was null ("held (write) by a process on HOST"), though the
/// table and /proc showed it.
#[test]
fn a_lock_kept_by_the_command_of_a_killed_exec_names_that_command() {
    // The command closes the lease it inherited, keeping the lock.
    let close_lease = r#"for f in /proc/$$/fd/*; do case $(readlink "$f") in *.lease) eval "exec ${f##*/}>&-";; esac; done; "#;
    for prefix in ["", close_lease] {
        let env = Env::new();
        env.make_image("k");
        let started = env.sentinel("started");
        // One process holds the lock (a loop's children would hold it too), ended by the test.
        let script = format!("{prefix}echo $$ > '{}'; exec sleep 60", started.display());
        let mut exec = env.spawn(["exec", "--write", "k", "--", "sh", "-c", &script]);
        wait_until("the command runs", || {
            fs::read_to_string(&started).is_ok_and(|t| t.ends_with('\n'))
        });
        let command: u64 = fs::read_to_string(&started)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        exec.signal(libc::SIGKILL);
        let _ = exec.child.as_mut().unwrap().wait();
        let entry = env.lock_entry("k").unwrap();
        let text = stdout(&env.ok(["lock-status"]));
        let out = env.run(["exec", "--read", "k", "--no-wait", "--", "true"]);
        // SAFETY: the pid of our child's command, which we end.
        unsafe { libc::kill(command as i32, libc::SIGKILL) };
        if !table_names_holders(&env) {
            eprintln!("skipping: this filesystem's lock table names no holder");
            return;
        }
        let holders = entry["holders"].as_array().unwrap();
        assert_eq!(holders.len(), 1, "{entry}");
        assert_eq!(holders[0]["pid"], command, "{entry}");
        assert_eq!(holders[0]["kept"], true, "{entry}");
        assert!(holders[0]["since"].is_string(), "{entry}");
        assert_eq!(code(&out), Some(75), "{}", show(&out));
        let said = format!("held (write) by pid {command} ");
        assert!(stderr(&out).contains(&said), "{}", show(&out));
        assert!(
            stderr(&out).contains("after the exec that took it ended"),
            "{}",
            show(&out)
        );
        assert!(
            text.contains("[kept it after the exec that took it ended]"),
            "{text}"
        );
    }
}

/// Whether the root's filesystem is one whose lock table names every holder's pid (local).
fn table_names_holders(env: &Env) -> bool {
    let fs = env.status_json(Vec::<String>::new())["filesystem"].clone();
    ["ext4", "tmpfs", "xfs", "btrfs", "overlay"]
        .iter()
        .any(|f| fs == *f)
}

/// A slot taken as docs/slots.md shows a script taking one (`exec 9<>FILE; flock 9`, the flock(1)
/// child gone, the shell's descriptor holding it) is held outside stowage, once: it was said kept
/// after an exec that took it ended, once per process sharing the descriptor.
#[test]
fn a_slot_a_script_took_by_flock_on_a_descriptor_is_held_outside_stowage() {
    let env = Env::new();
    env.ok(["slots", "set", "pull", "1"]);
    let file = env.root.join("locks/slots/pull/0.lock");
    let started = env.sentinel("started");
    let script = format!(
        "exec 9<>'{}'; flock 9; touch '{}'; sleep 30",
        file.display(),
        started.display()
    );
    let mut c = Command::new("bash");
    c.args(["-c", &script]);
    let script = Bg::from_command(c);
    wait_for_file(&started);
    let slot = env.slot_entry("pull").unwrap();
    let holders = slot["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{slot}");
    assert_ne!(holders[0]["kept"], true, "{slot}");
    assert_eq!(holders[0]["stowage"], false, "{slot}");
    let out = env.run(["exec", "--slot", "pull", "--no-wait", "--", "true"]);
    assert!(
        stderr(&out).contains("not started by stowage"),
        "{}",
        show(&out)
    );
    script.kill_all();
}

/// A lock a command running inside a live exec takes itself, with flock(1), is held outside
/// stowage: its environment names a lease alive, not an exec that ended (it was said kept).
#[test]
fn a_lock_a_command_inside_a_running_exec_takes_itself_is_held_outside_stowage() {
    let env = Env::new();
    env.make_image("x");
    env.make_image("n");
    let lock = env.lock_file("n");
    let started = env.sentinel("started");
    let script = format!(
        "exec 9<>'{}'; flock 9; touch '{}'; exec sleep 30",
        lock.display(),
        started.display()
    );
    let exec = env.spawn(["exec", "--read", "x", "--", "bash", "-c", &script]);
    wait_for_file(&started);
    let entry = env.lock_entry("n").unwrap();
    let text = stdout(&env.ok(["lock-status", "n"]));
    exec.kill_all();
    if !table_names_holders(&env) {
        eprintln!("skipping: this filesystem's lock table names no holder");
        return;
    }
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry}");
    assert_ne!(holders[0]["kept"], true, "{entry}");
    assert!(text.contains("[outside stowage]"), "{text}");
}

/// A command waiting for a slot lists the images it takes after it: lock-status shows it as
/// queued on each (in text and JSON, and among the busy locks it lists by default), and gc, which
/// keeps those images for it, says why instead of calling a free image "in use".
#[test]
fn a_command_queued_behind_a_slot_shows_on_the_images_it_will_take() {
    let env = Env::new();
    env.ok(["slots", "set", "build", "1"]);
    env.make_image_used_long_ago("base");
    let slot = env.hold_until(&["--slot", "build"], "slot", "slot-go");
    let queued = env.spawn(["exec", "--slot", "build", "--read", "base", "--", "true"]);
    env.wait_for_slot_waiters("build", 1);
    let json = env.status_json(Vec::<&str>::new());
    let base = json["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "base");
    let base = base.unwrap_or_else(|| panic!("base not listed: {json}"));
    assert_eq!(base["state"], "free", "{base}");
    assert_eq!(base["queued"].as_array().map(Vec::len), Some(1), "{base}");
    assert_eq!(base["queued"][0]["mode"], "shared", "{base}");
    assert_eq!(base["queued"][0]["command"], "true", "{base}");
    let text = stdout(&env.ok(["lock-status"]));
    assert!(text.contains("queued: pid"), "{text}");
    let gc = stdout(&env.ok(["gc", "--unused-for", "1d", "--dry-run"]));
    let said = "kept 'base': a waiting command will use it";
    assert!(gc.contains(said), "{gc}");
    let gc = stdout(&env.ok(["gc", "--unused-for", "1d", "--json"]));
    let gc: serde_json::Value = serde_json::from_str(&gc).unwrap();
    assert_eq!(gc["queued"], serde_json::json!(["base"]), "{gc}");
    assert_eq!(gc["busy"], serde_json::json!(["base"]), "{gc}");
    env.release("slot-go");
    for bg in [slot, queued] {
        let out = bg.finish();
        assert_eq!(code(&out), Some(0), "{}", show(&out));
    }
    let json = env.status_json(["base"]);
    assert_eq!(json["locks"][1]["queued"], serde_json::json!([]), "{json}");
}

/// Asserts `lock-status IMG` (run by `run`) shows the image with its state
/// unknown and says why on stderr, naming `cause`, and `--all` lists it.
fn shown_unknown(run: impl Fn(&[&str]) -> std::process::Output, cause: &str) {
    let out = run(&["lock-status", "app"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let row = stdout(&out)
        .lines()
        .find(|l| l.starts_with("app "))
        .map(str::to_owned);
    assert!(row.is_some_and(|r| r.contains("unknown")), "{}", show(&out));
    let err = stderr(&out);
    assert!(err.contains("image 'app': its state is not known"), "{err}");
    assert!(
        err.contains(cause) && !err.contains("does not exist"),
        "{err}"
    );
    let out = run(&["lock-status", "--all", "--json"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let locks = doc["locks"].as_array().unwrap();
    let app = locks
        .iter()
        .find(|l| l["kind"] == "image" && l["name"] == "app");
    assert!(app.is_some_and(|a| a["image_state"].is_null()), "{doc}");
    let base = locks.iter().find(|l| l["name"] == "base").unwrap();
    assert_eq!(base["image_state"], "ready", "{doc}");
    let out = run(&["lock-status", "--why", "app"]);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
}

/// An image whose lock file this user cannot open (its modes lost in a
/// group store) exists still, as `images` and `gc` keep it: `lock-status`
/// shows it, its state unknown and why, never "does not exist".
#[test]
fn an_image_whose_lock_file_cannot_be_opened_is_shown_unknown() {
    use std::os::unix::fs::PermissionsExt;
    let env = unprivileged_env();
    unprivileged_build(&env, "app", "true");
    unprivileged_build(&env, "base", "true");
    let lock = env.lock_file("app");
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o000)).unwrap();
    shown_unknown(|args| unprivileged(&env, args), "Permission denied");
}

/// An image whose record is damaged exists still: `lock-status` shows it,
/// its state unknown and why, never "does not exist".
#[test]
fn an_image_whose_record_is_damaged_is_shown_unknown() {
    let env = Env::new();
    env.make_image("app");
    env.make_image("base");
    let lock = env.lock_file("app");
    let mut bytes = fs::read(&lock).unwrap();
    for at in [0, 4096] {
        bytes[at..at + 8].copy_from_slice(b"garbage!");
    }
    fs::write(&lock, &bytes).unwrap();
    shown_unknown(|args| env.run(args), "damaged");
}

/// A nested `stowage exec` inherits its enclosing exec's lock (an image's,
/// a slot's); the enclosing exec SIGKILLed, the nested one holds it on
/// through that descriptor, which its own lease never lists. lock-status
/// names it by its pid, as kept, with its own lease: never "unknown
/// process … outside stowage, or on another host".
#[test]
fn a_nested_exec_that_kept_its_enclosing_execs_lock_is_named() {
    let env = Env::new();
    env.make_image("a");
    env.ok(["slots", "set", "pull", "1"]);
    for (outer, lock) in [(["--write", "x"], "x"), (["--slot", "pull"], "pull")] {
        let pidfile = env.sentinel(&format!("nested-{lock}"));
        let script = format!("echo $PPID > '{p}'; sleep 60", p = pidfile.display());
        let mut args = vec!["exec", outer[0], outer[1], "--", bin(), "--root"];
        let root = env.root.display().to_string();
        args.extend([
            root.as_str(),
            "exec",
            "--read",
            "a",
            "--",
            "sh",
            "-c",
            &script,
        ]);
        let mut bg = env.spawn(args);
        wait_until("the nested exec runs its command", || {
            fs::read_to_string(&pidfile).is_ok_and(|s| s.ends_with('\n'))
        });
        let nested: u32 = fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        bg.signal(libc::SIGKILL);
        let _ = bg.child.as_mut().unwrap().wait();
        let entry = match lock {
            "x" => env.lock_entry("x"),
            _ => env.slot_entry("pull"),
        };
        let entry = entry.unwrap();
        let text = stdout(&env.ok(["lock-status"]));
        bg.kill_all();
        if !table_names_holders(&env) {
            eprintln!("skipping: this filesystem's lock table names no holder");
            return;
        }
        let holder = &entry["holders"][0];
        assert_eq!(holder["pid"], nested, "{lock}: {entry:#}");
        assert_eq!(holder["kept"], true, "{lock}: {entry:#}");
        assert_eq!(holder["stowage"], true, "{lock}: {entry:#}");
        assert!(!text.contains("unknown process"), "{lock}: {text}");
    }
}
