# shellcheck shell=bash
# What scripts/ch-build and scripts/ch-delete share, sourced by both (they
# set $me, their name in messages, and the array stowage=(stowage [--root
# DIR])): the storage directory and the stowage root that keeps its images,
# times given on the command line, and running stowage so that signals
# reach what it runs. A library, not a program: it defines, and runs nothing.
# shellcheck disable=SC2154  # $me, $task, stowage: the wrapper's

fail() {
    echo "$me: $2" >&2
    exit "$1"
}

# Sets S from $CH_IMAGE_STORAGE: absolute, and a storage directory already
# (ch-image would initialise a missing one; a wrapper must not). S is its
# real path, symlinks resolved, whatever spelling names it: ch-image writes
# the path it is given into every linked image's .git, and a cache-mode
# command that is given another spelling rewrites them all, holding none of
# their locks. One that cannot be resolved is left as given, for the
# checks below to name.
storage_dir() {
    S=${CH_IMAGE_STORAGE:-}
    case $S in
        /*) ;;
        '') fail 64 'CH_IMAGE_STORAGE is not set (the storage directory, absolute)' ;;
        *) fail 64 "CH_IMAGE_STORAGE must be absolute: $S" ;;
    esac
    S=$(realpath -e -- "$S" 2>/dev/null) || S=$CH_IMAGE_STORAGE
    [ -d "$S/img" ] || ! present "$S/img" || fail 66 "$S/img is not a directory (a storage directory's images are there)"
    [ -d "$S/img" ] || fail 66 "$S is not a Charliecloud storage directory (no $S/img); set it up first (docs/charliecloud.md)"
}

# Sets root (absolute) to the stowage root, which must keep its images in
# $S/img: locks in another root protect nothing. `stowage slots` asks first,
# reading only, so that a mistyped root is refused and not created; then an
# exec with no image (which creates nothing in an existing root) names the
# root and its images directory, waiting at most what is left of --wait. Every command suggested here works as
# typed, however the root was named.
stowage_root() {
    local named err rc where dir n own fix
    named=${root_opt:-${STOWAGE_ROOT:-}}
    err=$("${stowage[@]}" slots 2>&1 >/dev/null)
    rc=$?
    case $rc in
        0) ;;
        66) # no such root, or a directory that holds no store
            fix="stowage${named:+ --root $(printf %q "$named")} init --images-dir $(printf %q "$S/img")"
            fail 64 "the stowage root ${named:-(the default one)} does not exist or holds no store (mistyped?); to keep this storage directory's locks there, run: $fix" ;;
        *) fail "$rc" "cannot ask stowage about its root: $err" ;;
    esac
    # shellcheck disable=SC2016  # expanded by that sh
    wait_left
    where=$("${stowage[@]}" exec "${wait[@]}" -- sh -c 'printf "%s\n%s" "$STOWAGE_ROOT" "$STOWAGE_IMAGES_DIR"') || exit
    root=${where%%$'\n'*} dir=${where#*$'\n'}
    [ "$dir" -ef "$S/img" ] && return
    n=$("${stowage[@]}" images --json | grep -o '"name":' | wc -l)
    if [ "$n" = 0 ]; then
        fix="stowage --root $(printf %q "$root") init --images-dir $(printf %q "$S/img")"
        fail 64 "the stowage root $root keeps its images in $dir, not in $S/img, so its locks would not protect this storage directory; run: $fix"
    fi
    # init refuses to move a root's images; a root of its own for this
    # storage directory, beside it, works (init names the root that keeps
    # $S/img already, if one does).
    own=${S%/}.stowage
    fix="stowage --root $(printf %q "$own") init --images-dir $(printf %q "$S/img")"
    fail 64 "the stowage root $root keeps images of its own ($n) in $dir, not in $S/img, so its locks would not protect this storage directory; name the root that keeps $S/img (--root or STOWAGE_ROOT), or make one: $fix"
}

# ch-image refuses a storage directory that holds imgtmp, which a cache-mode
# import makes while it runs (under `stowage exec --store-wide`). Waits for
# that hold to end, as long as --wait allows (its deadline),
# asking stowage (store_wide_held), never opening ROOT/locks/store.lock
# itself: flock(1) would block for good opening a FIFO planted there. An
# imgtmp still there then is looked at again once a network filesystem's
# cached names have expired (a FUSE client answers from its entry cache
# for a second: docs/shared-filesystems.md), within --wait; still there,
# it was left by an import that was stopped, and is refused, saying what
# to remove.
await_import() {
    local told='' held
    present "$S/imgtmp" || return 0
    [ -n "${root:-}" ] || stowage_root
    while :; do
        store_wide_held
        held=$?
        [ $held != 1 ] || break
        [ $held = 0 ] || fail 1 "cannot ask stowage whether a store-wide command holds $S/imgtmp: $why"
        [ -n "$told" ] || echo "$me: waiting for the store-wide command that holds $S/imgtmp (a ch-image import) to end" >&2
        told=1
        [ -z "$deadline" ] || (($(uptime_ms) < deadline)) || fail 75 "the store-wide command holding $S/imgtmp did not end within --wait $wait_text"
        sleep 0.2
    done
    present "$S/imgtmp" || return 0
    recheck_after_cache "$deadline"
    present "$S/imgtmp" || return 0
    store_wide_lock_usable
    fail 1 "$S/imgtmp was left by a ch-image import that was stopped (no store-wide command runs): remove it (rm -rf $(printf %q "$S/imgtmp")) and run this again"
}

# Whether a store-wide command holds the store (0) or not (1), as stowage's
# lock-status sees it (every host's holds, on a shared filesystem); 2, with
# stowage's message in $why, when it cannot say. stowage opens only a
# regular file at a lock's path, so a FIFO planted there blocks nothing.
store_wide_held() {
    local out
    out=$("${stowage[@]}" lock-status --json 2>/dev/null) || {
        why=$("${stowage[@]}" lock-status --json 2>&1 >/dev/null)
        return 2
    }
    python3 -c '
import json, sys
locks = json.loads(sys.argv[1])["locks"]
held = any(l["kind"] == "global" and l["name"] == "store" and l["state"] != "free" for l in locks)
sys.exit(0 if held else 1)' "$out" 2>/dev/null && return 0
    [ $? = 1 ] && return 1
    why="stowage lock-status --json gave no answer one can read"
    return 2
}

# A path the wrappers rely on being absent that a name cache may still
# show (a FUSE client's entry cache: 1 s by default) is looked at again
# only after that time, cut short at the deadline $1 (uptime_ms; empty:
# none).
recheck_after_cache() {
    local ms=1200 left
    if [ -n "$1" ]; then
        left=$(($1 - $(uptime_ms)))
        ((left > 0)) || left=0
        ((left >= ms)) || ms=$left
    fi
    ((ms == 0)) || sleep "$(seconds "$ms")"
}

# Refuses, naming it, a ROOT/locks/store.lock that is no regular file (a
# FIFO or a symlink planted there): stowage refuses to lock it, so no
# store-wide command can hold it, and imgtmp is not explained by a stopped
# import alone. Looked at by lstat, never opened.
store_wide_lock_usable() {
    local lock=$root/locks/store.lock kind
    [ -e "$lock" ] || [ -L "$lock" ] || return 0
    [ -L "$lock" ] || [ ! -f "$lock" ] || return 0
    kind=$(file_kind "$lock")
    fail 1 "$lock is $kind, not a regular file: refusing to use it; 'stowage doctor --repair' sets it aside (renamed, never deleted)"
}

# What path $1 is, as stowage names what it refuses: "a FIFO", "a symlink",
# "a directory"… (by lstat, never opened).
file_kind() {
    local k
    k=$(stat -c %F -- "$1" 2>/dev/null) || k='something else'
    case $k in
        fifo) k=FIFO ;;
        'symbolic link') k=symlink ;;
        'regular empty file') k='regular file' ;;
    esac
    case $k in [aeiou]*) echo "an $k" ;; *) echo "a $k" ;; esac
}

# Whether path $1 exists (0) or not (1), by lstat; 2 when that cannot be
# told, with the cause in $why. A test such as [ -e ] is false on any
# error: a network filesystem's client reconnecting (ENOTCONN), EIO,
# EACCES, and "cannot tell" must not read as "not there".
lookup() {
    local err
    if [ -e "$1" ] || [ -L "$1" ]; then return 0; fi
    err=$(LC_ALL=C stat -- "$1" 2>&1 >/dev/null) && return 0
    case $err in *'No such file or directory' | *'Not a directory') return 1 ;; esac
    why=${err##*: }
    return 2
}

# lookup, failing the wrapper, naming the path and the cause, when it
# cannot tell.
present() {
    lookup "$1"
    case $? in
        0) return 0 ;;
        1) return 1 ;;
    esac
    fail 1 "cannot tell whether $1 exists: $why"
}

# Milliseconds in a time, read as stowage reads --wait: a number (fractional
# allowed) and an optional unit (ms, s, m, h, d, w, or spelled out: 500ms,
# 10s, 1.5m, 2hours, 1d; bare seconds), as stowage reads --wait (README.md,
# "Times"); a value refused here is handed to stowage (start_deadline), whose
# message refuses it. Integers only: no awk or bc, whose
# comparisons of "1m" or "500ms" are of strings.
time_ms() {
    local t=$1 number unit whole frac scale
    # Spaces around the value and between its number and unit, as stowage allows.
    t=${t#"${t%%[![:space:]]*}"}
    t=${t%"${t##*[![:space:]]}"}
    number=${t%%[[:alpha:]]*}
    unit=${t#"$number"}
    number=${number%"${number##*[![:space:]]}"}
    case $unit in
        '' | s | sec | secs | second | seconds) scale=1000 ;;
        ms | msec) scale=1 ;;
        m | min | mins | minute | minutes) scale=60000 ;;
        h | hr | hrs | hour | hours) scale=3600000 ;;
        d | day | days) scale=86400000 ;;
        w | week | weeks) scale=604800000 ;;
        *) return 1 ;;
    esac
    # A negative time, or one past stowage's ten years, is left to stowage to refuse.
    number=${number#+}
    [[ $number != -* || ${number#-} =~ ^0*\.?0*$ ]] || return 1
    number=${number#-}
    [[ $number =~ ^[0-9]*(\.[0-9]*)?$ && $number == *[0-9]* ]] || return 1
    whole=${number%%.*} frac=
    ((${#whole} <= 15 && 10#${whole:-0} <= 315360000000 / scale)) || return 1
    [[ $number != *.* ]] || frac=${number#*.}
    frac=${frac}000000
    echo $(((10#${whole:-0} * 1000000 + 10#${frac:0:6}) * scale / 1000000))
}

# Milliseconds as seconds for people and for stowage's --wait: 60, 0.5.
seconds() {
    local s=$(($1 / 1000)) f
    f=$(printf %03d $(($1 % 1000)))
    while [[ $f == *0 ]]; do f=${f%0}; done
    echo "$s${f:+.$f}"
}

# The deadline of --wait ($wait_text; uptime_ms, empty for none), set once
# when the wrapper starts: every wait it does, its own and stowage's, draws
# on it, so that --wait bounds them all together rather than each anew. A
# time this parser refuses is handed to stowage, whose message refuses it;
# so is an empty one ($wait_given: --wait was given), which stowage refuses
# too, and which must not read as "no --wait" (wait for ever).
start_deadline() {
    deadline= wait_ms=
    [ -n "$wait_given" ] || return 0
    wait_ms=$(time_ms "$wait_text") || {
        "${stowage[@]}" exec --wait "$wait_text" -- true >/dev/null || exit
        fail 64 "--wait $wait_text: not a time"
    }
    deadline=$(($(uptime_ms) + wait_ms))
}

# wait=(--wait REST): what is left of --wait, for the next stowage.
wait_left() {
    local left
    wait=()
    [ -n "$deadline" ] || return 0
    left=$((deadline - $(uptime_ms)))
    ((left > 0)) || left=0
    wait=(--wait "$(seconds "$left")")
}

# Milliseconds since boot: a clock that no change of the date moves.
uptime_ms() {
    local up
    read -r up _ </proc/uptime
    echo $((10#${up//./} * 10))
}

# The termination signals the wrapper's caller left ignored (nohup ignores
# SIGHUP; a script's `ch-build … &` ignores SIGINT and SIGQUIT), read from
# the kernel before this shell sets any trap. Sets defaults to the others,
# comma-separated: those run_child starts at their default disposition.
# An ignore by the caller stays an ignore for stowage and the build, as
# stowage keeps it for its own command.
caller_ignores() {
    local key value mask='' sig n
    while read -r key value; do
        [ "$key" != SigIgn: ] || mask=$value
    done 2>/dev/null </proc/$$/status
    defaults=''
    for sig in INT QUIT TERM HUP; do
        n=$(kill -l "$sig")
        if [ "$sig" = QUIT ]; then
            # bash ignores SIGQUIT itself, always, so the kernel's mask says
            # nothing of the caller; `trap -p` shows one ignored on entry.
            [ -n "$(trap -p QUIT)" ] && continue
        elif [ -n "$mask" ] && (((16#$mask >> (n - 1)) & 1)); then
            continue
        fi
        defaults+=${defaults:+,}$sig
    done
}

# From now on, signals to the wrapper go to the stowage it runs
# (run_child), which forwards them to its command; with no stowage running,
# they end the wrapper at once, with 128+N, saying that nothing was done
# ($task names the work). $signalled keeps the last one, for the wrapper's
# report. A signal the caller ignored stays ignored (bash cannot trap it).
# The handlers only set variables and call builtins, with every value fixed
# here: bash 5.2's parser is not re-entrant, and a command substitution in
# a handler that a second signal interrupted failed to parse.
forward_signals() {
    local sig
    caller_ignores
    passed_on
    child='' signalled=''
    for sig in TERM INT HUP QUIT; do
        # shellcheck disable=SC2064  # the signal's name and number, fixed now
        trap "on_signal $sig $(kill -l "$sig")" "$sig"
    done
    # No number: on_signal never ends the wrapper for these.
    for sig in "${pass_on[@]}"; do
        # shellcheck disable=SC2064  # the name, fixed now
        trap "on_signal $sig 0" "$sig"
    done
}
# A signal that asks for no end (SIGUSR1, SIGUSR2, SIGALRM, the real-time
# ones) goes on to stowage too, and kills no wrapper; with no stowage
# running, there is nothing to pass it to, and it is dropped.
on_signal() {
    if [ -n "$child" ]; then
        # shellcheck disable=SC2034  # the wrapper's report reads it
        signalled=$1
        kill -s "$1" "$child" 2>/dev/null
        return
    fi
    case " ${pass_on[*]} " in *" $1 "*) return ;; esac
    signalled=$1
    fail $((128 + $2)) "stopped by SIG$1 before $task started: nothing was changed"
}

# Sets pass_on to the signals that each layer passes on as themselves and
# never dies of: SIGUSR1, SIGUSR2, SIGALRM and every real-time signal
# (RTMIN+N, named from the number bash gives RTMIN here; stowage takes the
# one its lock waits use, SIGRTMIN+5, and does not pass it on).
passed_on() {
    local n min max
    pass_on=(USR1 USR2 ALRM)
    min=$(kill -l RTMIN 2>/dev/null) max=$(kill -l RTMAX 2>/dev/null) || return 0
    for ((n = min; n <= max; n++)); do pass_on+=("RTMIN+$((n - min))"); done
    pass_on[${#pass_on[@]} - 1]=RTMAX
    [ "$min" != "$max" ] || pass_on[${#pass_on[@]} - 1]=RTMIN
}

# Runs a command as $child and returns its status. It starts with default
# dispositions for the signals the caller did not ignore (a non-interactive
# shell's background job would otherwise ignore SIGINT and SIGQUIT), in the
# background so that our traps run while it does; no job control, and its
# end (even by a signal) is not reported on stderr.
run_child() {
    if [ -n "$defaults" ]; then
        env --default-signal="$defaults" "$@" &
    else
        "$@" &
    fi
    child=$!
    local rc
    # wait returns early (>128) when a trapped signal arrives: wait again.
    while :; do
        wait "$child" 2>/dev/null
        rc=$?
        kill -0 "$child" 2>/dev/null || break
    done
    child=
    return $rc
}

# Under the locks: runs a command (ch-image, or ch-plan running ch-image's
# code) in a process group of its own and passes every termination signal
# to that whole group, since ch-image does not pass signals on to its RUN
# step. SIGINT goes on as SIGTERM, which ends ch-image (Python) quietly
# where SIGINT would print a traceback; the exit status still says SIGINT
# (130). SIGUSR1, SIGUSR2, SIGALRM and the real-time signals go on to the
# group as themselves (pass_on). The command starts with SIGTERM at its default even where the
# caller ignored it: its process group only ever gets the signals this shell
# sends it, and a SIGINT that went on as an ignored SIGTERM stopped nothing.
# Once the command has exited, however it ended (a signal to
# ch-image alone, the OOM killer), what is left of its group is ended
# (end_group) before this returns the command's status: ch-image starts
# its RUN steps without the lock descriptors (close_fds), so only this
# shell, the command of the stowage exec that took the locks, keeps them
# for as long as any process of the build may write.
run_group() {
    local pid='' got='' send='' rc sig
    passed_on
    for sig in TERM INT HUP QUIT "${pass_on[@]}"; do
        # shellcheck disable=SC2064  # the names, fixed now
        trap "group_signal $sig ${sig/#INT/TERM}" "$sig"
    done
    # end_group's pauses, as a read that times out on a pipe nobody writes
    # (held open both ways here, so it never ends early): no fork, which a
    # pids limit the build has exhausted would refuse. Made now, before the
    # build can take every pid.
    quiet=''
    exec {quiet}<> <(:) || quiet=
    # Job control for the start only: bash then puts the job in its group in
    # parent and child alike, so a signal sent at once still reaches it. Off
    # again, so that the shell does not report the job's end on stderr
    # ("[1]+ Terminated ...").
    set -m
    if [ -n "$quiet" ]; then
        env --default-signal=TERM "$@" </dev/null {quiet}>&- &
    else
        env --default-signal=TERM "$@" </dev/null &
    fi
    pid=$!
    set +m
    [ -z "$got" ] || kill -s "$send" -- "-$pid" 2>/dev/null
    while :; do
        wait "$pid" 2>/dev/null
        rc=$?
        if [ $rc -le 128 ] || ! kill -0 "$pid" 2>/dev/null; then break; fi
    done
    end_group "$pid"
    [ "$got" != INT ] || [ $rc != 143 ] || rc=130
    return $rc
}
# A trap handler of run_group's (its variables): sets and kills only, with
# the names fixed when the trap was set (see forward_signals), so that a
# second signal while it runs does no harm.
group_signal() {
    got=$1 send=$2
    [ -z "${pid-}" ] || kill -s "$2" -- "-$pid" 2>/dev/null
}

# Ends what is left of process group $1, whose leader has exited: SIGTERM,
# then SIGKILL once 5 s have passed (the grace stowage's --no-inherit keeper
# gives), and returns only when no live process of it is left. A group that
# is already empty costs one kill(2).
end_group() {
    local i
    group_lives "$1" || return 0
    kill -s TERM -- "-$1" 2>/dev/null
    for ((i = 0; i < 50; i++)); do
        group_lives "$1" || return 0
        pause
    done
    while group_lives "$1"; do
        kill -s KILL -- "-$1" 2>/dev/null
        pause
    done
}
# A tenth of a second without a fork (builtins only): a read that times out
# on run_group's quiet pipe; sleep(1) only where that pipe could not be made
# or the read fails at once, so that the loop still waits.
pause() {
    local _
    if [ -n "${quiet-}" ]; then
        read -r -t 0.1 -u "$quiet" _
        [ $? -le 128 ] || return 0
    fi
    sleep 0.1
}

# Whether process group $1 has a live member. kill -0 counts zombies too
# (an orphan whose reaper has not reaped it yet writes nothing), so /proc
# decides: in each stat, after the command's name, the state and the group.
group_lives() {
    local f s state group
    kill -0 -- "-$1" 2>/dev/null || return 1
    for f in /proc/[0-9]*/stat; do
        s=''
        read -r -d '' s 2>/dev/null <"$f"
        s=${s##*) }
        read -r state _ group _ <<<"$s"
        [ "${group-}" = "$1" ] && [ "$state" != Z ] && [ "$state" != X ] && return 0
    done
    return 1
}
