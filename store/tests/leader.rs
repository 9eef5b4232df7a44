//! Leader election: a second candidate follows, takes over after the TTL, and takes over at
//! once when the holder's process on this boot is dead.

mod common;

use std::time::Duration;

use boxery_store::{Candidate, Leadership};
use common::{ChildGuard, store};

fn candidate(id: &str) -> Candidate {
    Candidate::current(id)
}

#[test]
fn second_candidate_follows_until_the_ttl_runs_out() {
    let (_d, s) = store();
    let a = candidate("a");
    let b = candidate("b");
    let ttl = Duration::from_millis(300);
    assert_eq!(
        s.try_lead("controllers", &a, ttl).unwrap(),
        Leadership::Leader { epoch: 1 }
    );
    match s.try_lead("controllers", &b, ttl).unwrap() {
        Leadership::Follower { holder, expires_in } => {
            assert_eq!(holder, "a");
            assert!(
                expires_in <= ttl && expires_in > Duration::from_millis(100),
                "{expires_in:?}"
            );
        }
        other => panic!("want Follower, got {other:?}"),
    }
    // Renewing keeps the epoch; other locks are independent.
    assert_eq!(
        s.try_lead("controllers", &a, ttl).unwrap(),
        Leadership::Leader { epoch: 1 }
    );
    assert_eq!(
        s.try_lead("other", &b, ttl).unwrap(),
        Leadership::Leader { epoch: 1 }
    );
    // a stops renewing (it is alive: same pid as b); b takes over after the TTL.
    std::thread::sleep(ttl + Duration::from_millis(50));
    assert_eq!(
        s.try_lead("controllers", &b, ttl).unwrap(),
        Leadership::Leader { epoch: 2 }
    );
    assert!(matches!(
        s.try_lead("controllers", &a, ttl).unwrap(),
        Leadership::Follower { .. }
    ));
    // Resigning lets a take over at once, with a higher epoch.
    s.resign("controllers", &a).unwrap(); // not the holder: no effect
    assert!(matches!(
        s.try_lead("controllers", &a, ttl).unwrap(),
        Leadership::Follower { .. }
    ));
    s.resign("controllers", &b).unwrap();
    assert_eq!(
        s.try_lead("controllers", &a, ttl).unwrap(),
        Leadership::Leader { epoch: 3 }
    );
}

#[test]
fn takes_over_at_once_when_the_holders_process_is_dead() {
    let (_d, s) = store();
    let mut sleeper = ChildGuard::spawn(std::process::Command::new("sleep").arg("30"));
    let me = candidate("me");
    let dead = Candidate {
        id: "sleeper".into(),
        pid: sleeper.pid(),
        boot_id: me.boot_id.clone(),
    };
    let ttl = Duration::from_secs(60);
    assert_eq!(
        s.try_lead("controllers", &dead, ttl).unwrap(),
        Leadership::Leader { epoch: 1 }
    );
    assert!(
        matches!(
            s.try_lead("controllers", &me, ttl).unwrap(),
            Leadership::Follower { .. }
        ),
        "holder alive"
    );
    sleeper.kill();
    assert_eq!(
        s.try_lead("controllers", &me, ttl).unwrap(),
        Leadership::Leader { epoch: 2 }
    );
}

#[test]
fn a_holder_on_another_boot_is_waited_out() {
    let (_d, s) = store();
    let me = candidate("me");
    let elsewhere = Candidate {
        id: "elsewhere".into(),
        pid: 999_999,
        boot_id: "another-boot".into(),
    };
    let ttl = Duration::from_millis(200);
    assert_eq!(
        s.try_lead("controllers", &elsewhere, ttl).unwrap(),
        Leadership::Leader { epoch: 1 }
    );
    assert!(matches!(
        s.try_lead("controllers", &me, ttl).unwrap(),
        Leadership::Follower { .. }
    ));
    std::thread::sleep(ttl + Duration::from_millis(50));
    assert_eq!(
        s.try_lead("controllers", &me, ttl).unwrap(),
        Leadership::Leader { epoch: 2 }
    );
}

#[test]
fn a_reused_pid_does_not_keep_a_dead_holder_alive() {
    let (d, s) = store();
    let me = candidate("me");
    // Record this very process as the holder, but with a start time that is not its own: a
    // process with the holder's pid runs, yet it is not the holder.
    let holder = Candidate {
        id: "old".into(),
        pid: std::process::id(),
        boot_id: me.boot_id.clone(),
    };
    let ttl = Duration::from_secs(60);
    s.try_lead("controllers", &holder, ttl).unwrap();
    let conn = rusqlite::Connection::open(d.path().join("store.db")).unwrap();
    conn.execute(
        "UPDATE leaders SET start_time = start_time + 1 WHERE lock = 'controllers'",
        [],
    )
    .unwrap();
    assert_eq!(
        s.try_lead("controllers", &me, ttl).unwrap(),
        Leadership::Leader { epoch: 2 }
    );
}
