package envd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/envd/gen/filesystempb"
)

// maxBufferedWatchEvents bounds what a polled watcher keeps between
// GetWatcherEvents calls; the oldest events are dropped beyond it.
const maxBufferedWatchEvents = 10000

// dirWatch turns fsnotify events under root into FilesystemEvents.
type dirWatch struct {
	root         string
	recursive    bool
	includeEntry bool
	w            *fsnotify.Watcher
	stop         chan struct{}
	stopOnce     sync.Once
	done         chan struct{}
}

// Filesystem type magic numbers (linux/magic.h) of network and FUSE mounts,
// where inotify misses remote changes.
var networkFSMagic = map[int64]string{
	0x6969:     "nfs",
	0xFF534D42: "cifs",
	0x517B:     "smb",
	0xFE534D42: "smb2",
	0x65735546: "fuse",
}

func networkMount(path string) (string, bool) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return "", false
	}
	name, ok := networkFSMagic[int64(st.Type)&0xFFFFFFFF]
	return name, ok
}

func newDirWatch(root string, recursive, includeEntry, allowNetwork bool) (*dirWatch, error) {
	fi, err := os.Stat(root)
	if err != nil {
		return nil, fsError(err, "watch "+root)
	}
	if !fi.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path is not a directory: %s", root))
	}
	if kind, ok := networkMount(root); ok && !allowNetwork {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("%s is on a %s mount; watching it needs allow_network_mounts", root, kind))
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("create watcher: %w", err))
	}
	d := &dirWatch{root: root, recursive: recursive, includeEntry: includeEntry, w: w, stop: make(chan struct{}), done: make(chan struct{})}
	if err := d.add(root); err != nil {
		_ = w.Close()
		return nil, fsError(err, "watch "+root)
	}
	return d, nil
}

// add watches dir and, when recursive, every directory below it.
func (d *dirWatch) add(dir string) error {
	if !d.recursive {
		return d.w.Add(dir)
	}
	return filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if p == dir {
				return err
			}
			return nil
		}
		if e.IsDir() {
			if err := d.w.Add(p); err != nil && p == dir {
				return err
			}
		}
		return nil
	})
}

func (d *dirWatch) close() {
	d.stopOnce.Do(func() { close(d.stop) })
	<-d.done
}

// run delivers events to emit until close is called or the watcher fails.
func (d *dirWatch) run(emit func(*filesystempb.FilesystemEvent)) {
	defer close(d.done)
	defer d.w.Close()
	for {
		select {
		case <-d.stop:
			return
		case err, ok := <-d.w.Errors:
			if !ok {
				return
			}
			_ = err
		case ev, ok := <-d.w.Events:
			if !ok {
				return
			}
			for _, fe := range d.translate(ev) {
				emit(fe)
			}
		}
	}
}

func (d *dirWatch) translate(ev fsnotify.Event) []*filesystempb.FilesystemEvent {
	rel, err := filepath.Rel(d.root, ev.Name)
	if err != nil {
		rel = ev.Name
	}
	if d.recursive && ev.Has(fsnotify.Create) {
		if fi, err := os.Lstat(ev.Name); err == nil && fi.IsDir() {
			_ = d.add(ev.Name)
		}
	}
	var out []*filesystempb.FilesystemEvent
	mk := func(t filesystempb.EventType) {
		fe := &filesystempb.FilesystemEvent{Name: rel, Type: t}
		if d.includeEntry && t != filesystempb.EventType_EVENT_TYPE_REMOVE && t != filesystempb.EventType_EVENT_TYPE_RENAME {
			if fi, err := os.Lstat(ev.Name); err == nil {
				fe.Entry = entryFromInfo(ev.Name, fi)
			}
		}
		out = append(out, fe)
	}
	if ev.Has(fsnotify.Create) {
		mk(filesystempb.EventType_EVENT_TYPE_CREATE)
	}
	if ev.Has(fsnotify.Write) {
		mk(filesystempb.EventType_EVENT_TYPE_WRITE)
	}
	if ev.Has(fsnotify.Remove) {
		mk(filesystempb.EventType_EVENT_TYPE_REMOVE)
	}
	if ev.Has(fsnotify.Rename) {
		mk(filesystempb.EventType_EVENT_TYPE_RENAME)
	}
	if ev.Has(fsnotify.Chmod) {
		mk(filesystempb.EventType_EVENT_TYPE_CHMOD)
	}
	return out
}

func (f *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystempb.WatchDirRequest], stream *connect.ServerStream[filesystempb.WatchDirResponse]) error {
	_, p, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return err
	}
	d, err := newDirWatch(p, req.Msg.GetRecursive(), req.Msg.GetIncludeEntry(), req.Msg.GetAllowNetworkMounts())
	if err != nil {
		return err
	}
	events := make(chan *filesystempb.FilesystemEvent, 1024)
	go d.run(func(e *filesystempb.FilesystemEvent) {
		select {
		case events <- e:
		case <-d.stop:
		}
	})
	defer d.close()
	f.s.watchers.trackStream(d)
	defer f.s.watchers.untrackStream(d)

	if err := stream.Send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Start{Start: &filesystempb.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	tick := time.NewTicker(keepaliveInterval(req.Header()))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return streamEnd(ctx)
		case <-d.done:
			return connect.NewError(connect.CodeUnavailable, errors.New("watcher stopped"))
		case e := <-events:
			if err := stream.Send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Filesystem{Filesystem: e}}); err != nil {
				return err
			}
		case <-tick.C:
			if err := stream.Send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Keepalive{Keepalive: &filesystempb.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		}
	}
}

// watcherManager holds polled watchers (CreateWatcher/GetWatcherEvents)
// and the streams of WatchDir so they can be stopped on shutdown.
type watcherManager struct {
	mu      sync.Mutex
	polled  map[string]*polledWatch
	streams map[*dirWatch]struct{}
}

type polledWatch struct {
	d      *dirWatch
	mu     sync.Mutex
	events []*filesystempb.FilesystemEvent
}

func newWatcherManager() *watcherManager {
	return &watcherManager{polled: map[string]*polledWatch{}, streams: map[*dirWatch]struct{}{}}
}

func (m *watcherManager) trackStream(d *dirWatch) {
	m.mu.Lock()
	m.streams[d] = struct{}{}
	m.mu.Unlock()
}

func (m *watcherManager) untrackStream(d *dirWatch) {
	m.mu.Lock()
	delete(m.streams, d)
	m.mu.Unlock()
}

func (m *watcherManager) closeAll() {
	m.mu.Lock()
	var all []*dirWatch
	for _, pw := range m.polled {
		all = append(all, pw.d)
	}
	for d := range m.streams {
		all = append(all, d)
	}
	m.polled = map[string]*polledWatch{}
	m.mu.Unlock()
	for _, d := range all {
		d.close()
	}
}

func (f *filesystemService) CreateWatcher(ctx context.Context, req *connect.Request[filesystempb.CreateWatcherRequest]) (*connect.Response[filesystempb.CreateWatcherResponse], error) {
	_, p, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	d, err := newDirWatch(p, req.Msg.GetRecursive(), req.Msg.GetIncludeEntry(), req.Msg.GetAllowNetworkMounts())
	if err != nil {
		return nil, err
	}
	pw := &polledWatch{d: d}
	go d.run(func(e *filesystempb.FilesystemEvent) {
		pw.mu.Lock()
		if len(pw.events) >= maxBufferedWatchEvents {
			pw.events = pw.events[1:]
		}
		pw.events = append(pw.events, e)
		pw.mu.Unlock()
	})
	var b [12]byte
	_, _ = rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	m := f.s.watchers
	m.mu.Lock()
	m.polled[id] = pw
	m.mu.Unlock()
	return connect.NewResponse(&filesystempb.CreateWatcherResponse{WatcherId: id}), nil
}

func (m *watcherManager) get(id string) (*polledWatch, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	pw, ok := m.polled[id]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", id))
	}
	return pw, nil
}

func (f *filesystemService) GetWatcherEvents(ctx context.Context, req *connect.Request[filesystempb.GetWatcherEventsRequest]) (*connect.Response[filesystempb.GetWatcherEventsResponse], error) {
	pw, err := f.s.watchers.get(req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	pw.mu.Lock()
	evs := pw.events
	pw.events = nil
	pw.mu.Unlock()
	return connect.NewResponse(&filesystempb.GetWatcherEventsResponse{Events: evs}), nil
}

func (f *filesystemService) RemoveWatcher(ctx context.Context, req *connect.Request[filesystempb.RemoveWatcherRequest]) (*connect.Response[filesystempb.RemoveWatcherResponse], error) {
	m := f.s.watchers
	m.mu.Lock()
	pw, ok := m.polled[req.Msg.GetWatcherId()]
	delete(m.polled, req.Msg.GetWatcherId())
	m.mu.Unlock()
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", req.Msg.GetWatcherId()))
	}
	pw.d.close()
	return connect.NewResponse(&filesystempb.RemoveWatcherResponse{}), nil
}
