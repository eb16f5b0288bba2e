//! Attacks on writes without the database (src/written.rs): what a
//! writer's record and marker leave to whoever comes next, when that is a
//! writer of the database's way, a fold, or a hostile root.

use std::fs;

use crate::common::*;

#[test]
fn a_writer_that_waited_for_a_fast_write_and_never_ran_leaves_the_image_ready() {
    // The fast write is unfolded when the waiting writer gets the lock: its
    // start must fold the record it read before taking the token away, not
    // the emptied lock file (which says the write left no outcome).
    let env = Env::new();
    env.make_image("base");
    let fast = env.hold(&["--write", "base"], "started");
    assert!(env.marker("base").exists(), "the write took no transaction");
    let waiter = env.spawn(["exec", "--write", "base", "--", "/nonexistent/cmd"]);
    env.wait_for_waiter("base");
    env.release("release");
    assert_eq!(fast.finish().status.code(), Some(0));
    let out = waiter.finish();
    assert!(
        stderr(&out).contains("cannot run"),
        "its command never ran: {}",
        show(&out)
    );
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "base", "--", "true"]);
}

#[test]
fn a_fast_write_that_succeeds_beside_a_repair_is_ready() {
    // `doctor --repair` renews the database's identity (tokens of a copy
    // restored over it stop counting) while the writer, which took no
    // transaction, runs: its record names the identity it started under.
    // The command exits 0, so the image is ready (spec: exec).
    let env = Env::new();
    env.make_image("base");
    let writer = env.hold(&["--write", "base"], "started");
    assert!(env.marker("base").exists(), "the write took no transaction");
    env.ok(["doctor", "--repair"]);
    env.release("release");
    assert_eq!(writer.finish().status.code(), Some(0));
    assert_eq!(env.state("base").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "base", "--", "true"]);
}

#[test]
fn a_symlink_planted_at_the_markers_directory_unlinks_nothing_outside() {
    let env = Env::new();
    env.make_image("a");
    env.make_image("a");
    env.ok(["images"]);
    let v = victim(&env);
    // A file named like a marker, which a fold would unlink.
    fs::write(v.join("a.dirty"), "precious").unwrap();
    fs::remove_dir_all(env.root.join("locks/leases")).unwrap();
    std::os::unix::fs::symlink(&v, env.root.join("locks/leases")).unwrap();
    // No marker can be made there (a lease refuses the link), so none is
    // listed there either: the store works on, the database's way.
    for args in [&["images"][..], &["gc"]] {
        env.ok(args);
    }
    env.ok(["exec", "--write", "a", "--", "true"]);
    env.ok(["exec", "--read", "a", "--", "true"]);
    assert_eq!(fs::read_to_string(v.join("a.dirty")).unwrap(), "precious");
    assert_intact(&v);
}

/// `cmd` run where `openat2` fails with `errno`, as on a kernel older than
/// 5.6 (ENOSYS) or under a container's seccomp profile (EPERM): a seccomp
/// filter installed in the child before it runs stowage.
#[cfg(target_arch = "x86_64")]
fn without_openat2(cmd: &mut std::process::Command, errno: u32) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only prctl(2) between fork and exec, on data the closure owns.
    unsafe {
        cmd.pre_exec(move || {
            let filter = [
                // A = seccomp_data.nr
                libc::sock_filter {
                    code: 0x20,
                    jt: 0,
                    jf: 0,
                    k: 0,
                },
                // if A == SYS_openat2 (437) fall through, else skip one
                libc::sock_filter {
                    code: 0x15,
                    jt: 0,
                    jf: 1,
                    k: 437,
                },
                // return SECCOMP_RET_ERRNO | errno
                libc::sock_filter {
                    code: 0x06,
                    jt: 0,
                    jf: 0,
                    k: 0x0005_0000 | errno,
                },
                // return SECCOMP_RET_ALLOW
                libc::sock_filter {
                    code: 0x06,
                    jt: 0,
                    jf: 0,
                    k: 0x7fff_0000,
                },
            ];
            let prog = libc::sock_fprog {
                len: filter.len() as u16,
                filter: filter.as_ptr() as *mut libc::sock_filter,
            };
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(libc::PR_SET_SECCOMP, 2, &prog as *const libc::sock_fprog) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn a_kernel_without_openat2_still_folds_writes() {
    for errno in [libc::ENOSYS, libc::EPERM] {
        let env = Env::new();
        env.make_image("a");
        let run = |args: &[&str]| {
            let mut c = env.cmd(args);
            without_openat2(&mut c, errno as u32);
            output(c)
        };
        let out = run(&["exec", "--write", "a", "--", "false"]);
        assert_eq!(code(&out), Some(1), "{errno}: {}", show(&out));
        assert!(env.marker("a").exists(), "{errno}: without the database");
        let out = run(&["images"]);
        assert_eq!(code(&out), Some(0), "{errno}: {}", show(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("incomplete"),
            "{errno}: the failed write is folded: {}",
            show(&out)
        );
        assert!(!env.marker("a").exists(), "{errno}: folded");
        let out = run(&["exec", "--write", "b", "--", "true"]);
        assert_eq!(code(&out), Some(0), "{errno}: {}", show(&out));
    }
}

#[test]
fn a_fast_write_finished_the_database_way_beside_a_store_wide_wait_stays_ready() {
    // A write that took no transaction but cannot end without one (here
    // its tree cannot be measured: deeper than the descriptors it may
    // open) records its outcome in the database. A store-wide command
    // waiting for its lock means no ready token is written then: its
    // `writing` record and marker must not outlive the row, or the next
    // fold takes the finished write for a dead one.
    let env = Env::new();
    env.make_image("a");
    env.make_image("a");
    env.ok(["images"]);
    let started = env.sentinel("started");
    let release = env.sentinel("release");
    let script = format!(
        "ulimit -n 30; exec '{bin}' --root '{root}' exec --write a -- sh -c 'cd \"$STOWAGE_IMAGE_DIR\"; i=0; while [ $i -lt 60 ]; do mkdir d; cd d; i=$((i+1)); done; touch {s}; while [ ! -e {r} ]; do sleep 0.01; done'",
        bin = bin(),
        root = env.root.display(),
        s = started.display(),
        r = release.display()
    );
    let mut c = std::process::Command::new("sh");
    c.args(["-c", &script]);
    let writer = Bg::from_command(c);
    wait_for_file(&started);
    assert!(env.marker("a").exists(), "the write took no transaction");
    let store_wide = env.spawn(["exec", "--store-wide", "--", "true"]);
    env.wait_for_waiter("a");
    env.release("release");
    let out = writer.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    let out = store_wide.finish();
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "a", "--", "true"]);
}

#[test]
fn a_fast_write_abandoned_after_a_repair_leaves_the_image_ready() {
    // The writer puts back the token it found, which names the identity
    // a repair has renewed meanwhile; its command never ran, so the image
    // is as it was: ready.
    let env = Env::new();
    // Made the database's way: a plain token, no writer's record.
    env.make_image("a");
    let (writer, _file) = env.paused(["exec", "--write", "a", "--", "true"], "exec-before-spawn");
    assert!(env.marker("a").exists(), "the write took no transaction");
    env.ok(["doctor", "--repair"]);
    writer.signal(libc::SIGTERM);
    let out = writer.finish();
    assert_eq!(code(&out), Some(143), "{}", show(&out));
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "a", "--", "true"]);
}

#[test]
fn a_look_that_cannot_record_does_not_count_its_own_fold_as_a_use() {
    // With no space even for the reserve, `images` folds in a transaction
    // it rolls back; the image locks it took to read the records are not
    // holders of the images.
    let Some(t) = Mount::tmpfs("size=8m,mode=0755") else {
        return;
    };
    let env = t.env();
    env.make_image("base");
    env.make_image("base");
    assert!(env.marker("base").exists(), "the write took no transaction");
    let _ = fs::remove_file(env.root.join("reserve"));
    let filler = t.dir.join("filler");
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=4k", "status=none"])
        .arg(format!("of={}", filler.display()))
        .output();
    let out = env.ok(["images", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "base")
        .unwrap();
    assert_eq!(row["state"], "ready", "{row}");
    assert_eq!(row["in_use"], false, "{row}");
    assert!(env.marker("base").exists(), "nothing recorded");
    fs::remove_file(&filler).unwrap();
}

#[test]
fn a_writer_whose_listing_missed_a_marker_takes_it_once_folded() {
    // On NFS a listing of `locks/leases` may miss a fresh marker. A writer
    // of the database's way then folds the record it reads under its lock
    // (written.rs) and takes the token away: the marker it left, beside an
    // empty lock file, would make the next fold mark the image incomplete
    // — after a start undone (its command never ran), an untouched image.
    if !gdb_or_skip() {
        return;
    }
    let env = Env::new();
    // Read long ago: a read of it asks the database, so the request below
    // goes the database's way.
    env.make_image_used_long_ago("old");
    env.make_image("a");
    env.make_image("a");
    let m = env.marker("a");
    assert!(m.exists(), "the write took no transaction");
    let aside = env.sentinel("marker-aside");
    let listed = env.sentinel("listed");
    let cmds = env.sentinel("gdb-cmds");
    fs::write(
        &cmds,
        format!(
            "set pagination off\n\
             break stowage::written::markers\n\
             run\n\
             delete\n\
             shell mv '{m}' '{aside}'\n\
             break stowage::written::Markers::any\n\
             continue\n\
             delete\n\
             shell mv '{aside}' '{m}'; touch '{listed}'\n\
             continue\n",
            m = m.display(),
            aside = aside.display(),
            listed = listed.display(),
        ),
    )
    .unwrap();
    let out = output(stowage_under_gdb(
        &env,
        &cmds,
        [
            "exec",
            "--write",
            "a",
            "--read",
            "old",
            "--",
            "/nonexistent/cmd",
        ],
    ));
    assert!(listed.exists(), "the listing was made: {}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("exited with code 01"),
        "its command could not run: {}",
        show(&out)
    );
    assert_eq!(env.state("a").as_deref(), Some("ready"));
    env.ok(["exec", "--read", "a", "--", "true"]);
}
