//! Reads and slot holders that write no metadata (their leases name them),
//! attacked with real processes: what gc may conclude from a last use that
//! a read no longer records every time.

use crate::common::*;

/// `stowage ARGS…` with the clock fixed at `now` (RFC 3339).
fn at(env: &Env, now: &str, args: &[&str]) -> std::process::Output {
    let mut c = env.cmd(args);
    c.env("STOWAGE_NOW", now);
    output(c)
}

fn ok_at(env: &Env, now: &str, args: &[&str]) -> std::process::Output {
    let out = at(env, now, args);
    assert_eq!(out.status.code(), Some(0), "stowage failed: {}", show(&out));
    out
}

/// A read within a few minutes of the recorded last use records nothing
/// (its image's last use is fresh enough): gc --unused-for shorter than
/// that must still not take the image for unused, since it was used a
/// moment ago.
#[test]
fn gc_unused_for_keeps_an_image_read_since_its_recorded_last_use() {
    let env = Env::new();
    ok_at(
        &env,
        "2026-01-01T00:00:00Z",
        &["exec", "--write", "base", "--", "true"],
    );
    // Read four minutes later: the recorded last use (00:00) is fresh
    // enough, so the read writes nothing.
    ok_at(
        &env,
        "2026-01-01T00:04:00Z",
        &["exec", "--read", "base", "--", "true"],
    );
    // One minute after that read, the image has not been unused for two.
    let out = ok_at(&env, "2026-01-01T00:05:00Z", &["gc", "--unused-for", "2m"]);
    assert!(
        env.root.join("img/base").is_dir(),
        "gc removed an image read a minute ago as unused for 2m: {}",
        show(&out)
    );
    let images = String::from_utf8_lossy(&ok_at(&env, "2026-01-01T00:05:00Z", &["images"]).stdout)
        .into_owned();
    assert!(images.contains("base"), "{images}");
    // Really unused for long: it goes (the test can fail).
    let out = ok_at(&env, "2026-01-01T01:00:00Z", &["gc", "--unused-for", "2m"]);
    assert!(
        !env.root.join("img/base").exists(),
        "an image unused for an hour is removed: {}",
        show(&out)
    );
}
