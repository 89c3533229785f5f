"""Fleet membership on etcd: instances keep a record under a lease
(`registrar`), routers follow the prefix (`watcher`); `etcd` is the small
client both use, `record` what an instance says of itself. Never imports vllm."""
