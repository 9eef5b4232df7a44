"""The official Python `kubernetes` client against `boxery serve --api-listen`: list, create,
patch, and watch resumed from a resourceVersion (tests/api.rs runs it).

Usage: k8s_client.py KUBECONFIG
Prints one line per check; exits non-zero on the first failure."""
import sys
import threading
import time

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

G, V, P = "boxery.dev", "v1alpha1", "vms"


def vm(name, cpus=1):
    return {
        "apiVersion": f"{G}/{V}",
        "kind": "Vm",
        "metadata": {"name": name, "labels": {"from": "python"}},
        "spec": {"resources": {"cpus": cpus, "memory": "512Mi", "disk": "1Gi"}, "source": {"image": "tiny"}},
    }


def main():
    config.load_kube_config(config_file=sys.argv[1])
    # VersionApi asks for /version/ (a trailing slash)
    print("version:", client.VersionApi().get_code().git_version)
    api = client.CustomObjectsApi()
    listed = api.list_cluster_custom_object(G, V, P)
    rv = listed["metadata"]["resourceVersion"]
    print(f"list: {len(listed['items'])} items at {rv}")

    made = api.create_cluster_custom_object(G, V, P, vm("py1"))
    assert made["metadata"]["name"] == "py1", made
    print("create: py1", made["metadata"]["resourceVersion"])
    try:
        api.create_cluster_custom_object(G, V, P, vm("py1"))
        raise SystemExit("a second create of py1 was not refused")
    except ApiException as e:
        assert e.status == 409, e
        print("create again: 409")

    patched = api.patch_cluster_custom_object(G, V, P, "py1", {"spec": {"resources": {"cpus": 2}}})
    assert patched["spec"]["resources"]["cpus"] == 2, patched
    print("patch: cpus 2")

    try:
        api.patch_cluster_custom_object(G, V, P, "py1", {"spec": {"resources": {"cpu": 2}}})
        raise SystemExit("a bad patch was not refused")
    except ApiException as e:
        assert e.status == 422 and "cpus" in e.body, (e.status, e.body)
        print("bad patch: 422")

    # a watch resumed from the list's revision sees the create and the patch, in order
    w = watch.Watch()
    seen = []
    for ev in w.stream(api.list_cluster_custom_object, G, V, P, resource_version=rv, timeout_seconds=5):
        o = ev["object"]
        seen.append((ev["type"], o["metadata"]["name"], o["spec"]["resources"]["cpus"]))
        if ev["type"] == "MODIFIED" and o["spec"]["resources"]["cpus"] == 2:
            w.stop()
    # (the store's watch carries each object as it is when the event is read, so a create
    # and a patch read together both show the patched object)
    assert seen[0][:2] == ("ADDED", "py1") and seen[-1] == ("MODIFIED", "py1", 2), seen
    print("watch from", rv, ":", [s[0] for s in seen])

    # a change made while watching arrives
    got = threading.Event()

    def change():
        time.sleep(0.5)
        api.patch_cluster_custom_object(G, V, P, "py1", {"metadata": {"labels": {"seen": "yes"}}})

    threading.Thread(target=change).start()
    w = watch.Watch()
    for ev in w.stream(api.list_cluster_custom_object, G, V, P, label_selector="from=python", timeout_seconds=10):
        if ev["object"]["metadata"].get("labels", {}).get("seen") == "yes":
            got.set()
            w.stop()
    assert got.is_set(), "the live change did not arrive"
    print("watch live: label seen")

    # DeleteOptions in the body, as the client sends them: a dry run deletes nothing, stale
    # preconditions are a 409, an option boxery cannot carry out is refused
    cur = api.get_cluster_custom_object(G, V, P, "py1")
    api.delete_cluster_custom_object(G, V, P, "py1", body=client.V1DeleteOptions(dry_run=["All"]))
    api.delete_cluster_custom_object(G, V, P, "py1", dry_run="All")
    assert api.get_cluster_custom_object(G, V, P, "py1")["metadata"]["uid"] == cur["metadata"]["uid"]
    print("delete dry run: kept")
    for pre in [client.V1Preconditions(resource_version="1"), client.V1Preconditions(uid="not-its-uid")]:
        try:
            api.delete_cluster_custom_object(G, V, P, "py1", body=client.V1DeleteOptions(preconditions=pre))
            raise SystemExit(f"a delete with stale preconditions {pre} was not refused")
        except ApiException as e:
            assert e.status == 409 and "Precondition failed" in e.body, (e.status, e.body)
    print("delete stale preconditions: 409")
    for kw in [{"propagation_policy": "Orphan"}, {"body": client.V1DeleteOptions(propagation_policy="Orphan")},
               {"grace_period_seconds": 30}]:
        try:
            api.delete_cluster_custom_object(G, V, P, "py1", **kw)
            raise SystemExit(f"a delete with {kw} was not refused")
        except ApiException as e:
            assert e.status == 422 and "not supported" in e.body, (e.status, e.body)
    print("delete unsupported options: 422")

    # (the uid alone: the controllers may write the status, and so the resourceVersion, meanwhile)
    api.delete_cluster_custom_object(G, V, P, "py1", body=client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=cur["metadata"]["uid"]), propagation_policy="Foreground"))
    print("delete: py1")


if __name__ == "__main__":
    main()
