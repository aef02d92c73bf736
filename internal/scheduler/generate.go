package scheduler

// Regenerate the protobuf and Connect code from spec/ (needs protoc,
// protoc-gen-go and protoc-gen-connect-go on PATH).
//go:generate protoc -I spec --go_out=../.. --go_opt=module=github.com/agentenv/agentenv --connect-go_out=../.. --connect-go_opt=module=github.com/agentenv/agentenv scheduler.proto
