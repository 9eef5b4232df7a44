"""Drive boxery's MCP server with the official Python MCP SDK (a client we did not write).

    python client.py tools BOXERY_BIN          # stdio, fake backend: tools, schemas, bad calls
    python client.py http  URL TOKEN_FILE      # streamable HTTP: auth, Origin, a tool call
    python client.py vm    BOXERY_BIN OUTDIR   # stdio, qemu backend: a real VM end to end
    python client.py lease BOXERY_BIN          # stdio, fake backend: vm_lease on a pool of 2
    python client.py remote BOXERY_BIN VM OUTDIR  # stdio through a context (BOXERY_CONTEXT):
                                               # a real VM on another home's serve
    python client.py computer BOXERY_BIN VM OUTDIR ACTIONS_JSON
                                               # vm_computer: each action in turn (an action
                                               # with "expect_error": true must fail); each
                                               # image saved as OUTDIR/shot-N.png, the results
                                               # as OUTDIR/results.json
    python client.py browser BOXERY_BIN VM OUTDIR ACTIONS_JSON
                                               # the same with vm_browser

BOXERY_HOME and BOXERY_BACKEND come from the environment. Exits non-zero with the reason on
the first failed check.
"""

import asyncio
import json
import os
import sys
import time

import jsonschema
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def text(res):
    return "".join(getattr(c, "text", "") for c in res.content)


async def call(s, name, args, ok=True):
    res = await s.call_tool(name, args)
    t = text(res)
    if ok:
        check(not res.is_error, f"{name} {json.dumps(args)[:300]} failed: {t}")
    else:
        check(res.is_error, f"{name} {json.dumps(args)[:300]} should fail, got: {t}")
    return res, t


def stdio_params(binary):
    env = {k: v for k, v in os.environ.items() if k.startswith(("BOXERY_", "PATH", "HOME"))}
    return StdioServerParameters(command=binary, args=["mcp"], env=env)


async def tools_mode(binary):
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            listed = (await s.list_tools()).tools
            names = {t.name for t in listed}
            for want in ["vm_apply", "vm_get", "vm_describe", "vm_delete", "vm_wait", "vm_manage",
                         "vm_lease", "vm_bash", "vm_read", "vm_write", "vm_edit", "vm_copy",
                         "vm_jobs", "vm_use", "vm_grant", "vm_patch", "vm_computer", "vm_browser"]:
                check(want in names, f"tool {want} missing from {sorted(names)}")
            for t in listed:
                schema = t.input_schema
                jsonschema.validators.validator_for(schema).check_schema(schema)
                check(schema.get("type") == "object", f"{t.name}: input schema is not an object")
                check(t.annotations is not None, f"{t.name}: no annotations")
                check(t.description and len(t.description) > 20, f"{t.name}: no description")
            by = {t.name: t for t in listed}
            check(by["vm_get"].annotations.read_only_hint is True, "vm_get is read-only")
            check(by["vm_delete"].annotations.destructive_hint is True, "vm_delete is destructive")

            # Bad calls: tool errors a model can act on.
            _, t = await call(s, "vm_bash", {"vm": "ghost", "command": "true"}, ok=False)
            check("not found" in t, f"unknown VM: {t}")
            _, t = await call(s, "vm_lease", {"action": "acquire", "pool": "p"}, ok=False)
            check("pool p not found" in t, f"vm_lease on a missing pool: {t}")
            _, t = await call(s, "vm_lease", {"action": "rent"}, ok=False)
            check("acquire" in t, f"vm_lease with a bad action: {t}")
            _, t = await call(s, "vm_apply", {"manifest": "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: a\nspec:\n  source:\n    image: debian-12\n  resources:\n    cpus: lots\n"}, ok=False)
            check("spec.resources.cpus" in t or "cpus" in t, f"invalid manifest names no field: {t}")
            _, t = await call(s, "vm_bash", {"command": "x" * 70000, "vm": "a"}, ok=False)
            check("too large" in t, f"oversized argument: {t}")
            _, t = await call(s, "vm_bash", {"vm": "a"}, ok=False)
            check("command" in t, f"missing argument: {t}")
            res = await s.call_tool("no_such_tool", {})
            check(res.is_error, "an unknown tool is an error")

            # A Vm converges on the fake backend with no serve: the MCP server runs the controllers.
            _, t = await call(s, "vm_apply", {"manifest": "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: f1\nspec:\n  source:\n    image: debian-12\n", "timeout_seconds": 60})
            check("created" in t and "Ready" in t, f"vm_apply: {t}")
            _, t = await call(s, "vm_get", {})
            check("f1" in t, f"vm_get: {t}")
            _, t = await call(s, "vm_use", {})
            check("f1" in t, f"the applied VM is the default: {t}")
            # Grants: an agent asks, a person approves (never a tool); a forged approval in a
            # manifest's status is dropped.
            _, t = await call(s, "vm_grant", {"action": "request", "grant": "llm:anthropic", "from_env": "ANTHROPIC_API_KEY"})
            check("PendingApproval" in t and "boxery grant approve f1-llm-anthropic" in t, f"vm_grant request: {t}")
            _, t = await call(s, "vm_grant", {"action": "approve", "name": "f1-llm-anthropic"}, ok=False)
            check("request" in t, f"vm_grant has no approve action: {t}")
            forged = ("apiVersion: boxery.dev/v1alpha1\nkind: Grant\nmetadata: {name: forged}\n"
                      "spec: {vm: f1, type: env, target: TOKEN, valueFrom: {env: PATH}}\n"
                      "status: {phase: Applied, approvedBy: root, approvedGeneration: 1}\n")
            _, t = await call(s, "vm_apply", {"manifest": forged, "timeout_seconds": 60})
            check("PendingApproval" in t and "Applied" not in t.split("grant/forged")[-1].split("\n")[0], f"vm_apply of a forged approval: {t}")
            _, t = await call(s, "vm_grant", {"action": "list"})
            check("forged" in t and "PendingApproval" in t and "Applied" not in t, f"vm_grant list: {t}")
            # vm_patch: labels and resources of the session's VM; a dry run writes nothing; status
            # and the controllers' metadata are refused (the CLI's patch, label and scale verbs).
            _, t = await call(s, "vm_patch", {"patch": '{"metadata": {"labels": {"team": "web"}}}'})
            check("vm/f1 patched" in t and "team: web" in t, f"vm_patch labels: {t}")
            _, t = await call(s, "vm_patch", {"patch": "spec: {resources: {cpus: 3}}", "dry_run": True})
            check("dry run" in t and "cpus: 3" in t, f"vm_patch dry run: {t}")
            _, t = await call(s, "vm_get", {"name": "f1"})
            check("cpus: 1" in t, f"the dry run wrote nothing: {t}")
            _, t = await call(s, "vm_patch", {"type": "json", "patch": '[{"op": "replace", "path": "/spec/resources/cpus", "value": 2}]'})
            check("vm/f1 patched" in t and "cpus: 2" in t, f"vm_patch json: {t}")
            _, t = await call(s, "vm_patch", {"patch": '{"status": {"phase": "Stopped"}}'}, ok=False)
            check("status cannot be changed" in t, f"vm_patch of status: {t}")
            _, t = await call(s, "vm_patch", {"patch": '{"metadata": {"finalizers": []}}'}, ok=False)
            check("finalizers" in t, f"vm_patch of finalizers: {t}")
            # Egress: an agent may tighten its VM's policy, never loosen it (a person does).
            _, t = await call(s, "vm_patch", {"patch": '{"spec": {"network": {"egress": {"policy": "Allowlist", "allow": ["github.com", "*.pypi.org"]}}}}'})
            check("vm/f1 patched" in t and "Allowlist" in t, f"vm_patch tightens egress: {t}")
            _, t = await call(s, "vm_patch", {"patch": '{"spec": {"network": {"egress": {"allow": ["github.com"]}}}}'})
            check("vm/f1 patched" in t, f"vm_patch drops an allowed name: {t}")
            _, t = await call(s, "vm_patch", {"patch": '{"spec": {"network": {"egress": {"allow": ["github.com", "evil.example"]}}}}'}, ok=False)
            check("cannot loosen" in t and "allow adds evil.example" in t and "boxery patch vm f1" in t, f"vm_patch adds a name: {t}")
            _, t = await call(s, "vm_patch", {"patch": '{"spec": {"network": {"egress": {"policy": "Public"}}}}'}, ok=False)
            check("cannot loosen" in t and "Allowlist → Public" in t, f"vm_patch loosens the policy: {t}")
            loose = ("apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: f1\nspec:\n  source:\n    image: debian-12\n"
                     "  network:\n    egress:\n      policy: Public\n")
            _, t = await call(s, "vm_apply", {"manifest": loose, "force_conflicts": True}, ok=False)
            check("cannot loosen" in t, f"vm_apply loosens the policy: {t}")
            _, t = await call(s, "vm_get", {"name": "f1"})
            check("Allowlist" in t and "evil.example" not in t, f"egress unchanged: {t}")
            # A Source (what a person's `boxery sync` follows and prunes from) is never an agent's.
            src = "apiVersion: boxery.dev/v1alpha1\nkind: Source\nmetadata: {name: evil}\nspec: {url: /tmp/evil}\n"
            _, t = await call(s, "vm_apply", {"manifest": src}, ok=False)
            check("only a person" in t, f"vm_apply of a Source: {t}")
            _, t = await call(s, "vm_patch", {"kind": "source", "name": "x", "patch": "{}"}, ok=False)
            check("only a person" in t, f"vm_patch of a Source: {t}")
            _, t = await call(s, "vm_patch", {"type": "xml", "patch": "{}"}, ok=False)
            check("merge" in t and "json" in t, f"vm_patch with a bad type: {t}")
            _, t = await call(s, "vm_manage", {"action": "stop", "timeout_seconds": 60})
            check("Stopped" in t, f"stop: {t}")
            _, t = await call(s, "vm_bash", {"command": "true"}, ok=False)
            check("not ready" in t and "Stopped" in t, f"stopped VM: {t}")
            _, t = await call(s, "vm_manage", {"action": "rm", "timeout_seconds": 60})
            check("deleted" in t, f"rm: {t}")
    print("tools: ok")


async def http_mode(url, token_file):
    import httpx2
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    token = open(token_file).read().strip()
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}
    hdr = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    async with httpx2.AsyncClient() as c:
        r = await c.post(url, json=body, headers=hdr)
        check(r.status_code == 401, f"no token: {r.status_code}")
        r = await c.post(url, json=body, headers={**hdr, "Authorization": "Bearer wrong"})
        check(r.status_code == 401, f"wrong token: {r.status_code}")
        r = await c.post(url, json=body, headers={**hdr, "Authorization": f"Bearer {token}",
                                                   "Origin": "https://evil.example"})
        check(r.status_code == 403, f"wrong Origin: {r.status_code}")
        try:
            r = await c.post(url, content=b"x" * (9 << 20),
                             headers={**hdr, "Authorization": f"Bearer {token}"})
            check(r.status_code == 413, f"oversized body: {r.status_code}")
        except (httpx2.ReadError, httpx2.WriteError, httpx2.RemoteProtocolError):
            pass  # refused before the client finished sending: the connection was closed
    client = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with client:
        async with streamable_http_client(url, http_client=client) as streams:
            r, w = streams[0], streams[1]
            async with ClientSession(r, w) as s:
                await s.initialize()
                names = {t.name for t in (await s.list_tools()).tools}
                check("vm_bash" in names, f"tools over HTTP: {names}")
                _, t = await call(s, "vm_get", {})
                check("no vms" in t or "NAME" in t, f"vm_get over HTTP: {t}")
                _, t = await call(s, "vm_copy", {"src": "local:/etc/passwd", "dst": "x:/tmp/"}, ok=False)
                check("refused over HTTP" in t, f"local paths over HTTP: {t}")
                await call(s, "vm_apply", {"manifest": pool_yaml("hp", 1), "timeout_seconds": 60})
                await call(s, "vm_wait", {"kind": "pool", "name": "hp", "for": "jsonpath={.status.free}=1", "timeout_seconds": 120})
                res, t = await call(s, "vm_lease", {"action": "acquire", "pool": "hp", "timeout_seconds": 60})
                lease = res.structured_content["lease"]
                check(res.structured_content["vm"] == "hp-0", f"HTTP lease: {t}")
    # The client deleted its session on the way out: the lease goes, and the member comes back.
    client = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with client:
        async with streamable_http_client(url, http_client=client) as streams:
            async with ClientSession(streams[0], streams[1]) as s:
                await s.initialize()
                await call(s, "vm_wait", {"kind": "lease", "name": lease, "for": "delete", "timeout_seconds": 60})
                await call(s, "vm_wait", {"kind": "pool", "name": "hp", "for": "jsonpath={.status.free}=1", "timeout_seconds": 120})
    print("http: ok")


def pool_yaml(name, replicas):
    return (f"apiVersion: boxery.dev/v1alpha1\nkind: Pool\nmetadata: {{name: {name}}}\nspec:\n"
            f"  replicas: {replicas}\n  template:\n    spec:\n      source: {{image: debian-12}}\n")


async def lease_mode(binary):
    home = os.environ["BOXERY_HOME"]
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            await call(s, "vm_apply", {"manifest": pool_yaml("agents", 2), "timeout_seconds": 60})
            await call(s, "vm_wait", {"kind": "pool", "name": "agents", "for": "jsonpath={.status.free}=2", "timeout_seconds": 120})
            res, t = await call(s, "vm_lease", {"action": "acquire", "pool": "agents", "ttl_seconds": 60, "timeout_seconds": 60})
            sc = res.structured_content
            lease, vm = sc["lease"], sc["vm"]
            check(vm in ("agents-0", "agents-1") and "bound" in t, f"acquire: {t}")
            check(os.path.exists(os.path.join(home, "leases", lease, "id_ed25519")), "no lease key on this host")
            _, t = await call(s, "vm_use", {})
            check(vm in t, f"the leased VM is the session's default: {t}")
            res, t = await call(s, "vm_lease", {"action": "list"})
            mine = [l for l in res.structured_content["leases"] if l["lease"] == lease]
            check(mine and mine[0]["bound"] and mine[0]["held_by_this_session"] and mine[0]["vm"] == vm, f"list: {t}")
            res, t = await call(s, "vm_describe", {"kind": "pool", "name": "agents"})
            held = [m for m in res.structured_content["members"] if m["name"] == vm]
            check(held and held[0]["state"] == "Leased" and held[0]["lease"] == lease, f"the member is Leased: {t}")
            # The session renews by itself at a third of the TTL (20 s here).
            res, t = await call(s, "vm_get", {"kind": "lease", "name": lease})
            check("renewTime" not in t, f"renewed before its time: {t}")
            await asyncio.sleep(22)
            _, t = await call(s, "vm_get", {"kind": "lease", "name": lease})
            check("renewTime" in t, f"the session did not renew its lease: {t}")
            _, t = await call(s, "vm_lease", {"action": "renew"})
            check("renewed" in t, f"renew: {t}")
            _, t = await call(s, "vm_lease", {"action": "renew", "lease": lease, "holder": "mallory"}, ok=False)
            check("only its holder" in t, f"renew by another holder: {t}")
            # Release: the member is reset and Free again; the session has no default VM.
            _, t = await call(s, "vm_lease", {"action": "release", "timeout_seconds": 60})
            check("released" in t, f"release: {t}")
            check(not os.path.exists(os.path.join(home, "leases", lease)), "the lease key outlived the lease")
            await call(s, "vm_wait", {"kind": "pool", "name": "agents", "for": "jsonpath={.status.free}=2", "timeout_seconds": 120})
            _, t = await call(s, "vm_describe", {"kind": "pool", "name": "agents"})
            check("MemberReset" in t and f"{vm} was reset" in t, f"{vm} was not reset: {t[-1500:]}")
            _, t = await call(s, "vm_use", {})
            check("no default VM" in t, f"the released VM is still the default: {t}")
            _, t = await call(s, "vm_lease", {"action": "release"}, ok=False)
            check("which lease" in t, f"release with nothing held: {t}")
            res, _ = await call(s, "vm_lease", {"action": "acquire", "pool": "agents", "timeout_seconds": 60})
            ended = res.structured_content["lease"]
    # stdin closed: the session released its lease (and its controllers let it go on the way out).
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            _, t = await call(s, "vm_get", {"kind": "lease"})
            check(ended not in t, f"the lease outlived its session: {t}")
            await call(s, "vm_wait", {"kind": "lease", "name": ended, "for": "delete", "timeout_seconds": 60})
            await call(s, "vm_wait", {"kind": "pool", "name": "agents", "for": "jsonpath={.status.free}=2", "timeout_seconds": 120})
    # SIGTERM: released too (raw JSON-RPC lines, so the signal lands while the session is open).
    env = {k: v for k, v in os.environ.items() if k.startswith(("BOXERY_", "PATH", "HOME"))}
    p = await asyncio.create_subprocess_exec(binary, "mcp", env=env, stdin=asyncio.subprocess.PIPE,
                                             stdout=asyncio.subprocess.PIPE)

    async def rpc(i, method, params):
        p.stdin.write((json.dumps({"jsonrpc": "2.0", "id": i, "method": method, "params": params}) + "\n").encode())
        await p.stdin.drain()
        while True:
            m = json.loads(await asyncio.wait_for(p.stdout.readline(), 120))
            if m.get("id") == i:
                return m

    await rpc(1, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                "clientInfo": {"name": "t", "version": "1"}})
    p.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
    m = await rpc(2, "tools/call", {"name": "vm_lease", "arguments": {"action": "acquire", "pool": "agents", "timeout_seconds": 60}})
    check(not m["result"].get("isError"), f"acquire over raw stdio: {m}")
    signalled = m["result"]["structuredContent"]["lease"]
    p.terminate()
    code = await asyncio.wait_for(p.wait(), 30)
    check(code == 143, f"boxery mcp after SIGTERM exited {code}")
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            await call(s, "vm_wait", {"kind": "lease", "name": signalled, "for": "delete", "timeout_seconds": 60})
            await call(s, "vm_wait", {"kind": "pool", "name": "agents", "for": "jsonpath={.status.free}=2", "timeout_seconds": 120})
    print("lease: ok")


TINY = """apiVersion: boxery.dev/v1alpha1
kind: Vm
metadata:
  name: m1
spec:
  source:
    image: tiny
  resources:
    cpus: 1
    memory: 256Mi
    disk: 1Gi
"""


async def vm_mode(binary, outdir):
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            _, t = await call(s, "vm_apply", {"manifest": TINY, "timeout_seconds": 900})
            check("Ready=True" in t, f"m1 is not Ready: {t}")
            res, t = await call(s, "vm_bash", {"command": "hostname; echo err >&2; exit 3"})
            sc = res.structured_content
            check(sc["exit_code"] == 3 and sc["stdout"] == "m1\n" and sc["stderr"] == "err\n", f"vm_bash: {sc}")
            _, t = await call(s, "vm_bash", {"command": "pwd", "cwd": "/tmp"})
            check(t.strip() == "/tmp", f"cwd: {t}")
            # Output over the cap comes back truncated with a marker.
            res, t = await call(s, "vm_bash", {"command": "head -c 2000000 /dev/zero | tr '\\0' a"})
            check("output truncated" in t and res.structured_content["truncated_bytes"] > 0, f"cap: {t[-200:]}")
            # A timeout kills the command's process group.
            _, t = await call(s, "vm_bash", {"command": "sleep 300 & sleep 301; echo never", "timeout_seconds": 2}, ok=False)
            check("timed out" in t, f"timeout: {t}")
            _, t = await call(s, "vm_bash", {"command": "sleep 1; ps | grep -c '[s]leep 30'"}, ok=True)
            check(t.strip().startswith("0"), f"the timed-out command's group survived: {t}")

            # Files: write, read (range), edit, and the edit guard.
            _, t = await call(s, "vm_write", {"path": "~/src/app.txt", "content": "alpha\nbeta\ngamma\nbeta\n"})
            res, t = await call(s, "vm_read", {"path": "~/src/app.txt", "offset": 2, "limit": 2})
            check(res.structured_content["content"] == "beta\ngamma\n", f"vm_read range: {t}")
            _, t = await call(s, "vm_edit", {"path": "~/src/app.txt", "old": "beta", "new": "BETA"}, ok=False)
            check("2 times" in t, f"ambiguous edit: {t}")
            _, t = await call(s, "vm_edit", {"path": "~/src/app.txt", "old": "delta", "new": "x"}, ok=False)
            check("does not occur" in t, f"absent edit: {t}")
            _, t = await call(s, "vm_edit", {"path": "~/src/app.txt", "old": "gamma", "new": "GAMMA"})
            _, t = await call(s, "vm_bash", {"command": "cat ~/src/app.txt"})
            check(t == "alpha\nbeta\nGAMMA\nbeta\n", f"after edit: {t!r}")
            await call(s, "vm_bash", {"command": "echo sneaky >> ~/src/app.txt"})
            _, t = await call(s, "vm_edit", {"path": "~/src/app.txt", "old": "alpha", "new": "A"}, ok=False)
            check("changed since you read it" in t, f"stale edit: {t}")
            await call(s, "vm_read", {"path": "~/src/app.txt"})
            await call(s, "vm_edit", {"path": "~/src/app.txt", "old": "alpha", "new": "A"})
            await call(s, "vm_bash", {"command": "head -c 3000 /dev/urandom > ~/blob; printf 'a\\0b' >> ~/blob"})
            _, t = await call(s, "vm_read", {"path": "~/blob"}, ok=False)
            check("binary" in t, f"binary read: {t}")
            _, t = await call(s, "vm_read", {"path": "~/nope"}, ok=False)
            check("no such file" in t, f"missing file: {t}")

            # Jobs: start, wait, logs, list, kill; real exit codes; unknown ids.
            res, t = await call(s, "vm_jobs", {"action": "start", "command": "echo working; sleep 1; echo done; exit 5"})
            jid = res.structured_content["id"]
            res, t = await call(s, "vm_jobs", {"action": "wait", "id": jid, "timeout_seconds": 60})
            check(res.structured_content["exit_code"] == 5, f"job exit code: {t}")
            res, t = await call(s, "vm_jobs", {"action": "logs", "id": jid})
            check("working\ndone\n" in t, f"job logs: {t}")
            res, t = await call(s, "vm_jobs", {"action": "start", "command": "sleep 600"})
            k = res.structured_content["id"]
            _, t = await call(s, "vm_jobs", {"action": "list"})
            check(jid in t and k in t and "running" in t, f"job list: {t}")
            res, t = await call(s, "vm_jobs", {"action": "kill", "id": k})
            check(res.structured_content["exit_code"] == 143, f"killed job: {t}")
            _, t = await call(s, "vm_jobs", {"action": "wait", "id": "jdeadbeef"}, ok=False)
            check("no job jdeadbeef" in t, f"unknown job: {t}")

            # Copy a file out, then a directory VM to the same VM (VM⇄VM path).
            dst = os.path.join(outdir, "app.txt")
            await call(s, "vm_copy", {"src": "m1:src/app.txt", "dst": f"local:{dst}"})
            check(open(dst).read().startswith("A\nbeta\nGAMMA"), f"copied file: {open(dst).read()!r}")
            await call(s, "vm_copy", {"src": "m1:src", "dst": "m1:/tmp/src2"})
            _, t = await call(s, "vm_bash", {"command": "cat /tmp/src2/app.txt | head -1"})
            check(t.strip() == "A", f"VM to VM copy: {t}")
    # A job outlives the MCP server: start one, restart the server, wait for it.
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            res, _ = await call(s, "vm_jobs", {"vm": "m1", "action": "start", "command": "sleep 3; exit 9"})
            jid = res.structured_content["id"]
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            res, t = await call(s, "vm_jobs", {"vm": "m1", "action": "wait", "id": jid, "timeout_seconds": 60})
            check(res.structured_content["exit_code"] == 9, f"job across restarts: {t}")
            _, t = await call(s, "vm_delete", {"names": ["m1"], "timeout_seconds": 120})
            check("deleted" in t, f"delete: {t}")
    print("vm: ok")


async def grants_mode(binary):
    """vm_grant with a client that can ask its person (elicitation): yes approves, no denies,
    a dismissal leaves the grant pending; a client without elicitation is told to have a person
    run `boxery grant approve`."""
    from mcp import types
    asked = []

    def answering(action, content=None):
        async def cb(ctx, params):
            asked.append(params.message)
            return types.ElicitResult(action=action, content=content)
        return cb

    vm = "apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata:\n  name: g1\nspec:\n  source:\n    image: debian-12\n"
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w, elicitation_callback=answering("accept", {"approve": True})) as s:
            await s.initialize()
            _, t = await call(s, "vm_apply", {"manifest": vm, "timeout_seconds": 60})
            _, t = await call(s, "vm_grant", {"action": "request", "grant": "llm:anthropic", "from_env": "PATH"})
            check("approved by the person" in t, f"an accepted elicitation approves: {t}")
            check(asked and "anthropic" in asked[-1] and "PATH" in asked[-1] and "g1" in asked[-1],
                  f"the person is shown what is granted to which VM: {asked}")
            for _ in range(100):
                _, t = await call(s, "vm_grant", {"action": "list"})
                if "Applied" in t:
                    break
                await asyncio.sleep(0.2)
            check("Applied" in t, f"the approved grant is applied: {t}")
            # Asking again for an approved grant asks nobody.
            n = len(asked)
            _, t = await call(s, "vm_grant", {"action": "request", "grant": "llm:anthropic", "from_env": "PATH"})
            check(len(asked) == n and "already approved" in t, f"no second question: {t}")
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w, elicitation_callback=answering("decline")) as s:
            await s.initialize()
            _, t = await call(s, "vm_grant", {"action": "request", "vm": "g1", "grant": "github:me/repo", "from_env": "PATH"})
            check("denied" in t, f"a declined elicitation denies: {t}")
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w, elicitation_callback=answering("cancel")) as s:
            await s.initialize()
            _, t = await call(s, "vm_grant", {"action": "request", "vm": "g1", "grant": "env:TOKEN", "from_env": "PATH"})
            check("PendingApproval" in t and "dismissed" in t and "boxery grant approve" in t, f"a dismissed question leaves it pending: {t}")
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            _, t = await call(s, "vm_grant", {"action": "request", "vm": "g1", "grant": "file:npmrc", "from_env": "PATH"})
            check("PendingApproval" in t and "boxery grant approve g1-file-npmrc" in t, f"no elicitation: {t}")
            _, t = await call(s, "vm_grant", {"action": "list"})
            for want in ["Applied", "Denied", "PendingApproval"]:
                check(want in t, f"list shows {want}: {t}")
    print("grants: ok")


async def api_mode(url, full_token, read_token, ca):
    """MCP behind the Kubernetes-compatible API (`serve --api-listen`): over TLS with the
    home's CA, with the API's tokens: none 401, read-only 403, a browser Origin 403; a full
    token gets the tools, as a remote client (local paths refused)."""
    import ssl

    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    ctx = ssl.create_default_context(cafile=ca)
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}
    hdr = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    async with httpx2.AsyncClient(verify=ctx) as c:
        r = await c.post(url, json=body, headers=hdr)
        check(r.status_code == 401, f"no token: {r.status_code}")
        r = await c.post(url, json=body, headers={**hdr, "Authorization": f"Bearer {read_token}"})
        check(r.status_code == 403, f"read-only token: {r.status_code}")
        r = await c.post(url, json=body, headers={**hdr, "Authorization": f"Bearer {full_token}",
                                                   "Origin": "https://evil.example"})
        check(r.status_code == 403, f"an Origin: {r.status_code}")
    client = httpx2.AsyncClient(verify=ctx, headers={"Authorization": f"Bearer {full_token}"},
                                timeout=httpx2.Timeout(30.0, read=300.0))
    async with client:
        async with streamable_http_client(url, http_client=client) as streams:
            async with ClientSession(streams[0], streams[1]) as s:
                await s.initialize()
                names = {t.name for t in (await s.list_tools()).tools}
                check("vm_bash" in names, f"tools through the API: {names}")
                _, t = await call(s, "vm_get", {})
                check("no vms" in t or "NAME" in t, f"vm_get through the API: {t}")
                _, t = await call(s, "vm_copy", {"src": "local:/etc/passwd", "dst": "x:/tmp/"}, ok=False)
                check("refused over HTTP" in t, f"local paths through the API: {t}")
    print("api: ok")


async def remote_mode(binary, vm, outdir):
    """`boxery mcp` whose store and VMs are another home's (BOXERY_CONTEXT names it)."""
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            _, t = await call(s, "vm_get", {"kind": "vm"})
            check(vm in t, f"the context's VMs are listed: {t}")
            await call(s, "vm_use", {"vm": vm})
            res, t = await call(s, "vm_bash", {"command": "hostname; exit 4"})
            sc = res.structured_content
            check(sc["exit_code"] == 4 and sc["stdout"] == f"{vm}\n", f"vm_bash: {sc}")
            await call(s, "vm_write", {"path": "~/remote.txt", "content": "from the laptop\n"})
            res, t = await call(s, "vm_read", {"path": "~/remote.txt"})
            check(res.structured_content["content"] == "from the laptop\n", f"vm_read: {t}")
            dst = os.path.join(outdir, "remote.txt")
            await call(s, "vm_copy", {"src": f"{vm}:remote.txt", "dst": f"local:{dst}"})
            check(open(dst).read() == "from the laptop\n", f"copied: {open(dst).read()!r}")
            res, t = await call(s, "vm_jobs", {"action": "start", "command": "exit 6"})
            jid = res.structured_content["id"]
            res, t = await call(s, "vm_jobs", {"action": "wait", "id": jid, "timeout_seconds": 60})
            check(res.structured_content["exit_code"] == 6, f"job: {t}")
    print("remote: ok")


async def computer_mode(binary, vm, outdir, actions_json, tool="vm_computer"):
    import base64
    results = []
    async with stdio_client(stdio_params(binary)) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            for i, a in enumerate(json.loads(actions_json)):
                expect_error = a.pop("expect_error", False)
                started = time.time()
                res, t = await call(s, tool, {"vm": vm, **a}, ok=not expect_error)
                took = time.time() - started
                images = [c for c in res.content if getattr(c, "type", "") == "image"]
                saved = None
                for c in images:
                    mime = getattr(c, "mime_type", None) or getattr(c, "mimeType", None)
                    check(mime == "image/png", f"image content of {mime}")
                    saved = os.path.join(outdir, f"shot-{i}.png")
                    with open(saved, "wb") as f:
                        f.write(base64.b64decode(c.data))
                results.append({"action": a, "text": t, "error": res.is_error,
                                "data": res.structured_content, "image": saved,
                                "seconds": took})
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{tool}: ok")


def main():
    mode = sys.argv[1]
    started = time.time()
    if mode == "tools":
        asyncio.run(tools_mode(sys.argv[2]))
    elif mode == "http":
        asyncio.run(http_mode(sys.argv[2], sys.argv[3]))
    elif mode == "api":
        asyncio.run(api_mode(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]))
    elif mode == "grants":
        asyncio.run(grants_mode(sys.argv[2]))
    elif mode == "lease":
        asyncio.run(lease_mode(sys.argv[2]))
    elif mode == "vm":
        asyncio.run(vm_mode(sys.argv[2], sys.argv[3]))
    elif mode == "remote":
        asyncio.run(remote_mode(sys.argv[2], sys.argv[3], sys.argv[4]))
    elif mode == "computer":
        asyncio.run(computer_mode(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]))
    elif mode == "browser":
        asyncio.run(computer_mode(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], "vm_browser"))
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(f"{mode}: {time.time() - started:.1f}s")


if __name__ == "__main__":
    main()
