//! Tool ⇄ CLI parity: every tool names its `boxery` command(s) (or says why it has none), and
//! every command is either named by a tool or listed here with why it has no tool. A new
//! tool or command fails this test until its other half exists or a reason is written down.

use clap::CommandFactory;

use boxery_mcp::{CliSide, tools};

/// Commands with no tool, and why.
const CLI_ONLY: &[(&str, &str)] = &[
    ("diff", "vm_apply {dry_run: true} shows what would change"),
    (
        "sync",
        "follows a directory or repository as a service, an operator's choice; agents apply objects with vm_apply",
    ),
    (
        "explain",
        "reference for humans; tool schemas and errors carry the field docs",
    ),
    (
        "schema",
        "reference for editors; the tools' input schemas are in tools/list",
    ),
    ("ssh", "an interactive terminal; agents use vm_bash"),
    (
        "attach",
        "an interactive terminal on the agent's tmux session; agents delegate with vm_prompt",
    ),
    (
        "forward",
        "holds a port open on the person's machine until interrupted; an agent reaches a guest's ports from inside it with vm_bash",
    ),
    (
        "desktop",
        "serves a page to a person's browser until interrupted; an agent sees and drives the screen with vm_computer",
    ),
    (
        "images",
        "reference for operators (the guest layers); an agent asks for layers in an Image it writes with vm_apply",
    ),
    (
        "drill",
        "an operator's isolation check that makes host interfaces (as root); an agent must not probe the host",
    ),
    (
        "incus",
        "an operator's escape hatch to Incus on the VM host: it can take a container off the isolation stack, which an agent must never do",
    ),
    ("serve", "runs the control plane (and serves MCP over HTTP)"),
    (
        "kubeconfig",
        "mints API tokens: a person's grant of access to the whole home, never an agent's",
    ),
    ("mcp", "is the MCP server"),
    (
        "config",
        "chooses which machine's control plane this boxery works on: a person's setting, never an agent's",
    ),
    (
        "connect",
        "ssh's ProxyCommand for a context's VMs; agents reach VMs with vm_bash",
    ),
    (
        "service",
        "installs a systemd unit on the host: the owner's decision, never an agent's",
    ),
    ("help", "clap's help"),
    ("backends", "describes this build's backends, for operators"),
    (
        "usage",
        "the owner's account of what agents used, read on the VM host; an agent's own use shows in its grant's 429s",
    ),
    (
        "top",
        "the owner's live view of the host; an agent sees its own VM from inside it with vm_bash",
    ),
    (
        "audit",
        "the owner's record of what agents did; an agent must not read or steer the record of itself",
    ),
    (
        "api-resources",
        "reference for humans; tools/list names the kinds each tool takes",
    ),
    (
        "version",
        "for humans and bug reports; the MCP handshake carries the server's version",
    ),
    (
        "completion",
        "a shell completion script, for a person's shell",
    ),
    ("exec", "hidden: says to use run (vm_bash for agents)"),
    (
        "__complete-names",
        "hidden: object names for the shell completion scripts",
    ),
    (
        "orphans",
        "settling what a lost or rolled-back store left in the backend is the owner's decision, never an agent's",
    ),
    (
        "pool",
        "pools are declared by spec (vm_apply a Pool); membership is an operator's job",
    ),
    ("read", "hidden: the old name of `file read` (vm_read)"),
    ("write", "hidden: the old name of `file write` (vm_write)"),
    (
        "edit",
        "opens a person's editor; an agent writes the whole object with vm_apply",
    ),
];

#[test]
fn every_tool_has_a_command_and_every_command_a_tool() {
    let cli = crate::Cli::command();
    let commands: Vec<String> = cli
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .chain(std::iter::once("help".to_string()))
        .collect();
    let mut covered = std::collections::BTreeSet::new();
    for t in tools() {
        match t.cli {
            CliSide::Commands(cs) => {
                assert!(!cs.is_empty(), "{} names no command", t.name);
                for c in cs {
                    // `file read`: a command and its subcommand
                    let mut words = c.split(' ');
                    let top = words.next().unwrap_or_default();
                    let mut cmd = cli.find_subcommand(top);
                    for w in words {
                        cmd = cmd.and_then(|x| x.find_subcommand(w));
                    }
                    assert!(
                        cmd.is_some(),
                        "{} maps to `boxery {c}`, which does not exist",
                        t.name
                    );
                    covered.insert(top.to_string());
                }
            }
            CliSide::None(why) => assert!(why.len() > 10, "{}: say why it has no command", t.name),
        }
    }
    for c in &commands {
        let exempt = CLI_ONLY.iter().find(|(n, _)| n == c);
        assert!(
            covered.contains(c) || exempt.is_some(),
            "`boxery {c}` has no tool: add one to the table, or a reason to CLI_ONLY"
        );
        assert!(
            !(covered.contains(c) && exempt.is_some()),
            "`boxery {c}` has a tool and is listed in CLI_ONLY"
        );
    }
    for (n, _) in CLI_ONLY {
        assert!(
            commands.iter().any(|c| c == n),
            "CLI_ONLY names `{n}`, which is gone"
        );
    }
}

/// Every `vm_manage` action and `vm_jobs` action has a command of the same name.
#[test]
fn actions_have_commands() {
    let cli = crate::Cli::command();
    let names: Vec<&str> = cli.get_subcommands().map(|c| c.get_name()).collect();
    for a in [
        "new", "snap", "revert", "fork", "start", "stop", "resize", "rm",
    ] {
        assert!(names.contains(&a), "vm_manage {a} has no command");
    }
    let jobs = cli.find_subcommand("jobs").expect("jobs");
    let sub: Vec<&str> = jobs.get_subcommands().map(|c| c.get_name()).collect();
    for a in ["start", "list", "logs", "wait", "kill"] {
        assert!(sub.contains(&a), "vm_jobs {a} has no `boxery jobs {a}`");
    }
}

/// Every `vm_lease` action is a `boxery lease` subcommand, and every subcommand an action.
#[test]
fn lease_actions_are_lease_commands() {
    use boxery_mcp::lease::LeaseAction;
    let pairs = [
        (LeaseAction::Acquire, "acquire"),
        (LeaseAction::Renew, "renew"),
        (LeaseAction::Release, "release"),
        (LeaseAction::List, "ls"),
    ];
    let schema = boxery_mcp::find("vm_lease").unwrap().schema.to_string();
    let cli = crate::Cli::command();
    let lease = cli.find_subcommand("lease").expect("lease");
    let sub: Vec<&str> = lease.get_subcommands().map(|c| c.get_name()).collect();
    for (action, cmd) in pairs {
        let name = serde_json::to_value(action).unwrap();
        assert!(
            schema.contains(&name.to_string()),
            "vm_lease's schema lacks {name}"
        );
        assert!(
            sub.contains(&cmd),
            "vm_lease {name} has no `boxery lease {cmd}`"
        );
    }
    for c in sub {
        assert!(
            pairs.iter().any(|(_, cmd)| *cmd == c),
            "`boxery lease {c}` has no vm_lease action"
        );
    }
}

/// Every `vm_grant` action is a `boxery grant` form, and every `boxery grant` subcommand is an
/// action or a person's alone (approve, deny: no tool approves or denies a grant).
#[test]
fn grant_actions_are_grant_commands() {
    use boxery_mcp::grant::GrantAction;
    // `request` is `boxery grant VM TYPE:TARGET …` itself (no subcommand).
    let pairs = [(GrantAction::List, "ls"), (GrantAction::Revoke, "revoke")];
    let person_only = ["approve", "deny"];
    let schema = boxery_mcp::find("vm_grant").unwrap().schema.to_string();
    let cli = crate::Cli::command();
    let grant = cli.find_subcommand("grant").expect("grant");
    assert!(
        grant.get_arguments().any(|a| a.get_id() == "from_env"),
        "`boxery grant VM TYPE:TARGET --from-env NAME` is vm_grant's request"
    );
    assert!(schema.contains("\"request\""));
    let sub: Vec<&str> = grant.get_subcommands().map(|c| c.get_name()).collect();
    for (action, cmd) in pairs {
        let name = serde_json::to_value(action).unwrap();
        assert!(
            schema.contains(&name.to_string()),
            "vm_grant's schema lacks {name}"
        );
        assert!(
            sub.contains(&cmd),
            "vm_grant {name} has no `boxery grant {cmd}`"
        );
    }
    for c in sub {
        assert!(
            pairs.iter().any(|(_, cmd)| *cmd == c) || person_only.contains(&c),
            "`boxery grant {c}` has no vm_grant action and is not listed as a person's"
        );
    }
    for word in person_only {
        assert!(
            !schema.contains(&format!("\"{word}\"")),
            "vm_grant must not offer {word}"
        );
    }
}
