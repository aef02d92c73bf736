package vmm

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
)

// Restacking a disk: a QEMU started to wait for saved state (Incoming)
// has opened its root disk's top image over the backing chain its header
// names, but nothing of it is in use yet (the images stay inactive until
// the state loads). Restack slips more images between that top and its
// backing: each is opened read-only from a descriptor the node passes
// (QEMU, past its privilege drop, cannot open the store's files itself),
// stacked on the one below it, and the top is reopened over the highest
// (QMP blockdev-add, blockdev-reopen; about a millisecond). That lets a
// QEMU started before a fork over the RAM image and disk the fork stands
// on take one of its children, whose disk is the fork's newer images over
// the same base. The top's header still names the old backing: the
// caller rewrites it (the image is empty and QEMU has not written to it)
// before the state loads, when QEMU reads the header again.

// Node names of the root disk's image and of its file below it, given on
// the command line so that blockdev-reopen can name them.
const (
	rootImageNode = "root-image"
	rootFileNode  = "root-file"
)

// Restack stacks the qcow2 images at layers (highest first) between the
// root disk's top and the image now below it: the top's backing becomes
// layers[0], and the last layer's the old backing. Call it before the
// state loads (m started Incoming), with the top as Start opened it. On
// failure the disk is as it was.
func (m *Machine) Restack(ctx context.Context, layers []string) (err error) {
	if len(layers) == 0 {
		return nil
	}
	below, err := m.rootBacking(ctx)
	if err != nil {
		return err
	}
	sets, err := m.fdsets(ctx)
	if err != nil {
		return err
	}
	next := rootFdset + 1
	for _, set := range sets {
		next = max(next, set.FdsetID+1)
	}
	var top string // the node of layers[0], once added
	var added []int
	defer func() {
		if err == nil {
			return
		}
		undo := context.WithoutCancel(ctx)
		if top != "" {
			// Its inline backing images go with it.
			_, _ = m.qmp.Execute(undo, "blockdev-del", map[string]any{"node-name": top})
		}
		for _, id := range added {
			// (QEMU 7.2 closes a removed descriptor only once the machine
			// runs; the node destroys a machine whose restack failed.)
			_, _ = m.qmp.Execute(undo, "remove-fd", map[string]any{"fdset-id": id})
		}
	}()
	// Every layer's descriptor, then the whole chain in one blockdev-add,
	// each layer's backing defined inline in the one above it (a command
	// per layer costs ~1.4 ms here; sealed chains are up to 33 deep).
	var def any = below
	var name string // layers[0]'s, the new backing of the top
	for i := len(layers) - 1; i >= 0; i-- {
		id := next
		next++
		if err := m.passReadOnly(ctx, id, layers[i]); err != nil {
			return err
		}
		added = append(added, id)
		name = "restack-" + strconv.Itoa(id)
		def = map[string]any{"driver": "qcow2", "node-name": name, "read-only": true,
			"file":    map[string]any{"driver": "file", "filename": "/dev/fdset/" + strconv.Itoa(id), "locking": "off"},
			"backing": def}
	}
	if _, err := m.qmp.Execute(ctx, "blockdev-add", def); err != nil {
		return fmt.Errorf("restack: open the images: %w", err)
	}
	top = name
	// The top's options as the command line set them, with the new
	// backing (options left out of a reopen return to their defaults).
	if _, err := m.qmp.Execute(ctx, "blockdev-reopen", map[string]any{"options": []any{map[string]any{
		"driver": "qcow2", "node-name": rootImageNode, "file": rootFileNode, "backing": top,
		"discard": "unmap", "cache": map[string]any{"direct": false, "no-flush": false},
	}}}); err != nil {
		return fmt.Errorf("restack: reopen the root disk: %w", err)
	}
	return nil
}

// passReadOnly hands QEMU a read-only descriptor of path as fdset id.
func (m *Machine) passReadOnly(ctx context.Context, id int, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := m.qmp.ExecuteWithFile(ctx, "add-fd", map[string]any{"fdset-id": id, "opaque": fdRO}, f); err != nil {
		return fmt.Errorf("restack: pass %s: %w", path, err)
	}
	return nil
}

// rootBacking names the node below the root disk's image, which must
// still be the top.
func (m *Machine) rootBacking(ctx context.Context) (string, error) {
	top, err := m.rootTop(ctx)
	if err != nil {
		return "", err
	}
	if top.node != rootImageNode {
		return "", fmt.Errorf("restack: the root disk's top is %q, not the image it started on", top.node)
	}
	raw, err := m.qmp.Execute(ctx, "query-named-block-nodes", map[string]any{"flat": true})
	if err != nil {
		return "", err
	}
	var nodes []struct {
		NodeName    string `json:"node-name"`
		Drv         string `json:"drv"`
		File        string `json:"file"`
		BackingFile string `json:"backing_file"`
	}
	if err := json.Unmarshal(raw, &nodes); err != nil {
		return "", fmt.Errorf("query-named-block-nodes answered %s: %w", raw, err)
	}
	backing := ""
	for _, n := range nodes {
		if n.NodeName == rootImageNode {
			backing = n.BackingFile
		}
	}
	if backing == "" {
		return "", fmt.Errorf("restack: the root disk has no backing image")
	}
	for _, n := range nodes {
		if n.Drv == "qcow2" && n.File == backing && n.NodeName != rootImageNode {
			return n.NodeName, nil
		}
	}
	return "", fmt.Errorf("restack: no node opens the root disk's backing %s", backing)
}
