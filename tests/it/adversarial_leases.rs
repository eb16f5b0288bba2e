//! Attacks on holder leases (`lease.rs`): planted lease files, commands that
//! drop the lease they inherited, owners killed at each step.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use crate::common::*;

/// Holds `path` exclusively, from this (test) process.
fn hold(path: &std::path::Path) -> stowage::lock::Guard {
    stowage::lock::acquire_no_wait(
        path,
        stowage::lock::Mode::Exclusive,
        stowage::lock::IfMissing::Fail,
    )
    .unwrap()
    .expect("free")
}

#[test]
fn a_planted_fifo_lease_does_not_hang_lock_status() {
    let env = Env::new();
    env.make_image("app");
    // Someone who can write locks/leases plants a FIFO under a lease's name,
    // holds it exclusively (as an owner holds its lease) and holds an image
    // lock, so that lock-status looks for the identity of the lock's taker
    // in that "lease".
    let fifo = env.root.join("locks/leases/evil.lease");
    let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    // Opened read-write (as lock files are): a FIFO opened so never
    // blocks, and counts as its own writer, so a reader would wait for data
    // for good.
    let planted = hold(&fifo);
    let image = hold(&env.lock_file("app"));

    let mut c = env.cmd(["lock-status", "--json", "app"]);
    std::os::unix::process::CommandExt::process_group(&mut c, 0)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = wait_output(c.spawn().unwrap(), Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entry = v["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "image" && l["name"] == "app")
        .cloned()
        .unwrap();
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "still shown held: {entry:#}");
    assert_eq!(holders[0]["pid"], std::process::id(), "{entry:#}");
    assert_eq!(holders[0]["stowage"], false, "{entry:#}");
    drop((planted, image));
}

#[test]
fn a_command_that_closes_its_lease_stays_the_recorded_holder_after_stowage_dies() {
    let env = Env::new();
    env.make_image("app");
    // A command that closes every descriptor it inherited but its image lock
    // (closefrom, a daemon's hygiene): stowage's lease then lives only in
    // stowage itself.
    let started = env.sentinel("started");
    let release = env.sentinel("release");
    let script = format!(
        "for fd in /proc/$$/fd/*; do case $(readlink \"$fd\") in */locks/leases/*) eval \"exec ${{fd##*/}}>&-\";; esac; done; \
         touch '{s}'; i=0; while [ ! -e '{r}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
        s = started.display(),
        r = release.display()
    );
    let mut bg = env.spawn([
        "exec",
        "--write",
        "app",
        "--",
        "bash",
        "-c",
        &script,
        "closes-its-lease",
    ]);
    wait_for_file(&started);
    let stowage = bg.pid();
    // SIGKILL stowage only: the command keeps the image lock, not the lease.
    bg.signal(libc::SIGKILL);
    let _ = bg.child.as_mut().unwrap().wait();
    assert!(!flock_free(&env.lock_file("app")), "the command holds it");
    let entry = env.lock_entry("app").unwrap();
    let holders = entry["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{entry:#}");
    assert_eq!(holders[0]["stowage"], true, "not an outsider: {entry:#}");
    assert_eq!(holders[0]["pid"], stowage, "{entry:#}");
    assert!(
        holders[0]["command"]
            .as_str()
            .is_some_and(|c| c.contains("closes-its-lease")),
        "the record stands: {entry:#}"
    );
    assert_eq!(entry["state"], "exclusive", "{entry:#}");
    // The command ends: its record goes, and the image is incomplete.
    env.release("release");
    wait_until("the command released the image lock", || {
        flock_free(&env.lock_file("app"))
    });
    let entry = env.lock_entry("app").unwrap();
    assert!(entry["holders"].as_array().unwrap().is_empty(), "{entry:#}");
    assert_eq!(env.state("app").as_deref(), Some("incomplete"));
    bg.kill_all();
}

#[test]
fn a_planted_leases_symlink_gets_no_lease_made_through_it() {
    let env = Env::new();
    env.make_image("app");
    // Someone who can write locks/ points locks/leases at another directory.
    let victim = env.scratch.join("victim");
    std::fs::create_dir(&victim).unwrap();
    let leases = env.root.join("locks/leases");
    let _ = std::fs::remove_dir_all(&leases);
    std::os::unix::fs::symlink(&victim, &leases).unwrap();
    // Every process that locks makes a lease: exec, rm, gc.
    let listing = env.sentinel("listing");
    let out = env.run([
        "exec",
        "--write",
        "app",
        "--",
        "sh",
        "-c",
        &format!("ls -A '{}' > '{}'", victim.display(), listing.display()),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(
        std::fs::read_to_string(&listing).unwrap(),
        "",
        "no lease made outside the root while the command ran"
    );
    env.ok(["gc"]);
    env.ok(["rm", "app"]);
    assert!(
        std::fs::read_dir(&victim).unwrap().next().is_none(),
        "nothing created outside the root"
    );
    assert!(
        std::fs::symlink_metadata(&leases)
            .unwrap()
            .file_type()
            .is_symlink(),
        "left for doctor to name"
    );
}
