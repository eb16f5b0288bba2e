//! Image contents, sizes, gc's budget, clocks, printed records and a full
//! filesystem: what a store holds and what it says about it.

use crate::common::*;

/// Sets a time column of an image's row directly, as another host's clock
/// (or an older release) may have written it.
fn set_stored_time(env: &Env, image: &str, column: &str, ms: i64) {
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    let n = conn
        .execute(
            &format!("UPDATE images SET {column} = ?1 WHERE name = ?2"),
            rusqlite::params![ms, image],
        )
        .unwrap();
    assert_eq!(n, 1);
}

// --- clocks ---------------------------------------------------------------

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

#[test]
fn a_stored_time_past_year_9999_is_shown_as_unknown_not_a_panic() {
    let env = Env::new();
    env.make_image("app");
    set_stored_time(&env, "app", "created_ms", i64::MAX);
    set_stored_time(&env, "app", "last_used_ms", 1_795_953_784_000_000);
    let img = env.image("app").unwrap();
    assert!(img["created"].is_null(), "{img}");
    assert!(img["last_used"].is_null(), "{img}");
    let out = env.ok(["images"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("unknown"));
    env.status_json(["--all"]);
    env.ok(["lock-status", "--all"]);
    env.ok(["gc", "--unused-for", "1d", "--dry-run"]);
    // A holder whose record says it started after year 9999.
    let _h = env.hold(&["--read", "app"], "started");
    let conn = rusqlite::Connection::open(env.root.join("stowage.db")).unwrap();
    conn.execute("UPDATE records SET since_ms = ?1", [i64::MAX])
        .unwrap();
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

// --- printed records ------------------------------------------------------

#[test]
fn control_characters_of_a_recorded_command_are_escaped_when_printed() {
    let env = Env::new();
    env.make_image("app");
    // The holder's command carries a screen-clearing escape and a newline
    // that would forge a second table row.
    let evil = "\u{1b}[2J\u{1b}]0;pwned\u{7}\nglobal  global  free  forged";
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
    assert!(
        !text.contains('\u{1b}') && !text.contains('\u{7}'),
        "{text:?}"
    );
    assert!(!text.contains("\nglobal  global  free  forged"), "{text}");
    assert!(text.contains(r"\x1b[2J"), "{text}");

    let out = env.run(["exec", "--read", "app", "--no-wait", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", show(&out));
    let err = stderr(&out);
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");

    // JSON keeps the exact command (its encoder escapes it).
    let st = env.status_json(["app"]);
    let raw = serde_json::to_string(&st).unwrap();
    assert!(raw.contains(r"\u001b[2J"), "{raw}");
    env.release("release");
}
