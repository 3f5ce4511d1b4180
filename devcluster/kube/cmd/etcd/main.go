// Command etcd runs a single-member etcd server embedded from go.etcd.io/etcd/server/v3.
//
// `go install` of the etcd server module fails (its go.mod has replace directives), so the
// devcluster embeds it from the same module graph as Kubernetes, which already depends on it.
package main

import (
	"flag"
	"fmt"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.etcd.io/etcd/api/v3/version"
	"go.etcd.io/etcd/server/v3/embed"
)

func mustURL(raw string) url.URL {
	u, err := url.Parse(raw)
	if err != nil {
		log.Fatalf("invalid URL %q: %v", raw, err)
	}
	return *u
}

func main() {
	dataDir := flag.String("data-dir", "etcd-data", "directory for the etcd data")
	clientURL := flag.String("listen-client-url", "http://127.0.0.1:2379", "client URL to listen on")
	peerURL := flag.String("listen-peer-url", "http://127.0.0.1:2380", "peer URL to listen on")
	showVersion := flag.Bool("version", false, "print the etcd version and exit")
	flag.Parse()

	if *showVersion {
		fmt.Printf("etcd Version: %s\n", version.Version)
		return
	}

	cfg := embed.NewConfig()
	cfg.Name = "devcluster"
	cfg.Dir = *dataDir
	cfg.LogLevel = "warn"
	cfg.ListenClientUrls = []url.URL{mustURL(*clientURL)}
	cfg.AdvertiseClientUrls = cfg.ListenClientUrls
	cfg.ListenPeerUrls = []url.URL{mustURL(*peerURL)}
	cfg.AdvertisePeerUrls = cfg.ListenPeerUrls
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)

	server, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("starting etcd: %v", err)
	}
	defer server.Close()

	select {
	case <-server.Server.ReadyNotify():
		log.Printf("etcd %s ready on %s", version.Version, *clientURL)
	case <-time.After(60 * time.Second):
		server.Server.Stop()
		log.Fatal("etcd did not become ready within 60s")
	}

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	select {
	case sig := <-signals:
		log.Printf("received %s, stopping etcd", sig)
	case err := <-server.Err():
		log.Fatalf("etcd failed: %v", err)
	}
}
