//! Processes, signals and nested calls under attack: a command that calls
//! stowage again inside a store-wide hold, with and without --no-inherit.

use crate::common::*;

/// `stowage --root ROOT exec ARGS…` as a command line for an outer exec.
fn inner(env: &Env, args: &[&str]) -> Vec<String> {
    let mut v = vec![
        bin().to_owned(),
        "--root".into(),
        env.root.to_str().unwrap().to_owned(),
    ];
    v.extend(args.iter().map(|a| a.to_string()));
    v
}

#[test]
fn a_no_inherit_store_wide_command_may_call_stowage_itself() {
    let env = Env::new();
    env.make_image("a");
    // The keeper keeps the store's lease, not the command: the nested
    // exec is still inside the hold (its ancestor holds it) and must go
    // ahead rather than wait for the hold that waits for it.
    let mut args: Vec<String> = ["exec", "--no-inherit", "--store-wide", "--"]
        .map(String::from)
        .to_vec();
    args.extend(inner(
        &env,
        &[
            "exec", "--wait", "20", "--read", "a", "--write", "c", "--", "true",
        ],
    ));
    let out = env.run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("c").as_deref(), Some("ready"));

    // A removal inside it is inside the hold too.
    let mut args: Vec<String> = ["exec", "--no-inherit", "--store-wide", "--"]
        .map(String::from)
        .to_vec();
    args.extend(inner(&env, &["rm", "--wait", "20", "c"]));
    let out = env.run(&args);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(env.state("c"), None);
}

#[test]
fn a_store_wide_command_inside_another_fails_at_once() {
    for no_inherit in [false, true] {
        let env = Env::new();
        let mut args: Vec<String> = vec!["exec".into()];
        if no_inherit {
            args.push("--no-inherit".into());
        }
        args.extend(["--store-wide".into(), "--".into()]);
        args.extend(inner(
            &env,
            &["exec", "--wait", "20", "--store-wide", "--", "true"],
        ));
        let out = env.run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(75), "{}", show(&out));
        assert!(
            err.contains("enclosing command") && !err.contains("waiting for the store-wide"),
            "no-inherit {no_inherit}: should fail at once naming the enclosing hold: {err}"
        );
    }
}
